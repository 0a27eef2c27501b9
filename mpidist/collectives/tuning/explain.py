"""`mpidist explain`: per size, the algorithm auto runs and where the choice comes from: the
decision table's row (with the timings the tuner noted beside it) or the built-in rule.

    python -m mpidist.launcher -n 4 -- mpidist explain --sizes 4K,64K,1M,64M
    mpiexec -n 4 mpidist explain --table table.json --reps 5

It reads the table and the rule (collectives.select) and nothing else, so what it prints
is what a job with the same table runs; --reps adds a fresh timing of every algorithm at
each size, to set beside the tuner's. See docs/BENCHMARKS.md (tuning auto).
"""
from __future__ import annotations

import argparse
import math

from mpidist.collectives import select
from mpidist.collectives.tuning import timing, tune
from mpidist.comm import Communicator, as_communicator, mpi_library
from mpidist.sizes import format_size, parse_sizes

__all__ = ["explain", "main"]


def _nearest_note(entry: dict | None, nbytes: int) -> dict | None:
    """The tuner's note (the entry's "measured" list) for the tuned size nearest nbytes on
    a log scale; None without notes (a hand-written table has none)."""
    notes = entry.get("measured") if entry else None
    notes = [m for m in notes or [] if isinstance(m, dict) and isinstance(m.get("bytes"), int)
             and m["bytes"] > 0 and isinstance(m.get("us"), dict)]
    if not notes:
        return None
    return min(notes, key=lambda m: abs(math.log(m["bytes"] / nbytes)))


def _source(comm, table, path, nbytes: int, auto: str) -> str:
    """Where auto's choice at nbytes comes from, in words."""
    if comm.size == 1:
        return "one rank: native"
    if table is None:
        return "rule (no table)"
    found = table.row(select.layout_of(comm), nbytes)
    if found is None:
        return f"rule (table {path} has no entry for this layout)"
    i, end, name = found
    if name != auto:
        return f"rule (table row {i + 1}'s {name} cannot run on this communicator)"
    upto = "open-ended" if end >= (1 << 62) else f"to {format_size(end)}"
    return f"table row {i + 1} ({upto})"


def explain(sizes, comm=None, *, reps: int = 0) -> list[dict]:
    """Collective: per size, auto's algorithm and the reason.

    Rows: {"nbytes", "auto" (select.choose), "rule" (select.rule), "source" (the table row
    or the rule that decided, in words), "tuned" (the table's note for the nearest tuned
    size, or None), "measured" ({algorithm: seconds} with reps > 0, else None)}."""
    c = as_communicator(comm)
    path = select.table_path()
    table = select.load_table(path) if path is not None else None
    entry = table.entry(select.layout_of(c)) if table is not None else None
    names = tune.candidates(c) if c.size > 1 else ["native"]
    rows = []
    for nbytes in sizes:
        auto = select.choose(c, nbytes)
        rows.append({"nbytes": int(nbytes), "auto": auto, "rule": select.rule(c, nbytes),
                     "source": _source(c, table, path, nbytes, auto),
                     "tuned": _nearest_note(entry, nbytes),
                     "measured": timing.measure_all(c, names, nbytes, reps) if reps > 0
                     else None})
    return rows


def _times(us: dict, top: int = 4) -> str:
    """The fastest few of {algorithm: microseconds}, fastest first."""
    return ", ".join(f"{a} {t:.1f}" for a, t in sorted(us.items(), key=lambda kv: kv[1])[:top])


def main(argv: list[str] | None = None) -> int:
    """`mpidist explain`: auto's algorithm per size and the table row or rule behind it."""
    ap = argparse.ArgumentParser(prog="mpidist explain", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4K,64K,1M,16M", type=parse_sizes,
                    help="message sizes in bytes, comma separated (default 4K,64K,1M,16M)")
    ap.add_argument("--reps", type=int, default=0,
                    help="also time every algorithm at each size, in this many rounds "
                         "(default 0: read only)")
    ap.add_argument("--table", default=None,
                    help="the decision table to explain (default: env MPIDIST_ALGORITHM_TABLE)")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="simulate nodes of this many ranks (default: real topology)")
    args = ap.parse_args(argv)
    if args.reps < 0:
        ap.error("--reps must be >= 0")
    if args.table:
        select.use_table(args.table)
    c = Communicator(ranks_per_node=args.ranks_per_node)
    rows = explain(args.sizes, c, reps=args.reps)
    if c.rank == 0:
        print(f"# {mpi_library()}; {c.describe()}")
        print(f"# auto: {select.describe(c)}")
        print(f"{'size':>8} {'auto':>19} {'rule':>12}  from")
        for r in rows:
            print(f"{format_size(r['nbytes']):>8} {r['auto']:>19} {r['rule']:>12}  "
                  f"{r['source']}")
            note = r["tuned"]
            if note is not None:
                print(f"{'':>8} tuned at {format_size(note['bytes'])} (pick "
                      f"{note.get('pick', '?')}), median us: {_times(note['us'])}")
            if r["measured"] is not None:
                now = {a: t * 1e6 for a, t in r["measured"].items()}
                print(f"{'':>8} now ({args.reps} rounds), median us: {_times(now)}")
    c.free()
    return 0
