"""`mpidist tune`: measure this layout and write auto's decision table.

    python -m mpidist.launcher -n 4 -- mpidist tune --out allreduce-table.json
    srun -n 64 mpidist tune --out table.json --sizes 4K,64K,1M,16M,256M

At each size of the ladder the cost model shortlists the algorithms predicted within MARGIN
of its best, plus the built-in rule's choice; the shortlist is timed in interleaved rounds
(timing.measure_all: the same numbers on every rank) and the fastest wins the sizes up to
the geometric middle to the next size. Rank 0 writes the table (select.FORMAT) with the
timings as notes; an existing file keeps its other layouts. Point a job at it with
[parallel] algorithm_table or env MPIDIST_ALGORITHM_TABLE. See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

from mpidist.collectives import select
from mpidist.collectives.tuning import costmodel, timing
from mpidist.comm import Communicator, mpi_library
from mpidist.sizes import format_size, parse_sizes

__all__ = ["tune", "shortlist", "main", "DEFAULT_SIZES", "MARGIN", "SHORTLIST"]

# up to the largest size `mpidist bench allreduce` measures by default, so that its every
# size has a row measured for it rather than the last row's extrapolation
DEFAULT_SIZES = "8,512,4K,32K,256K,1M,4M,16M,64M,256M"
MARGIN = 3.0          # shortlist: predicted within this factor of the model's best
SHORTLIST = 5         # at most this many candidates from the model (the rule's pick joins)


def shortlist(model, comm, nbytes: int) -> list[str]:
    """The candidates timed at nbytes: the model's best within MARGIN, then the rule's."""
    predicted = sorted((model.predict(a, nbytes), k, a) for k, a in enumerate(model.candidates()))
    best = predicted[0][0]
    names = [a for t, _, a in predicted if t <= MARGIN * best or best <= 0][:SHORTLIST]
    ruled = select.rule(comm, nbytes)
    return names + ([ruled] if ruled not in names else [])


def tune(comm, model, sizes, reps: int = 5) -> dict:
    """Collective: time the shortlist at every size; returns the table entry for comm's
    layout (select.layout_of plus "sizes" rows and "measured" notes), the same on every rank."""
    measured, rows = [], []
    for k, nbytes in enumerate(sorted(sizes)):
        if comm.size == 1:
            names, times = ["native"], {"native": 0.0}
        else:
            names = shortlist(model, comm, nbytes)
            times = timing.measure_all(comm, names, nbytes, reps, seed=k)
        pick = min(names, key=lambda a: (times[a], names.index(a)))
        measured.append({"bytes": nbytes, "pick": pick, "model": model.choose(nbytes),
                         "rule": select.rule(comm, nbytes),
                         "us": {a: round(t * 1e6, 1) for a, t in times.items()}})
    for i, m in enumerate(measured):
        upto = None if i == len(measured) - 1 else \
            int(math.sqrt(m["bytes"] * measured[i + 1]["bytes"]))
        if rows and rows[-1]["algorithm"] == m["pick"]:
            rows[-1]["upto"] = upto                     # one row per run of equal picks
        else:
            rows.append({"upto": upto, "algorithm": m["pick"]})
    for row in rows:
        if row["upto"] is not None:
            row["upto"] = format_size(row["upto"])
    return {**select.layout_of(comm), "sizes": rows, "measured": measured}


def write_table(path: str, entry: dict, made: dict) -> dict:
    """Write entry into the table at path (its other layouts kept; an unreadable file is
    replaced) and return the document written. Called by one rank."""
    layouts = []
    try:
        with open(path) as f:
            old = json.load(f)
        select.Table(old, path)                          # only a valid table is merged
        key = [entry[k] for k in ("ranks", "nodes", "ranks_per_node")]
        layouts = [e for e in old["layouts"]
                   if [e[k] for k in ("ranks", "nodes", "ranks_per_node")] != key]
    except (OSError, ValueError):
        pass
    doc = {"format": select.FORMAT, "made": made, "layouts": layouts + [entry]}
    select.Table(doc, path)                              # what is written reads back
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return doc


def main(argv: list[str] | None = None) -> int:
    """`mpidist tune`: probe, time the shortlists, write the table (rank 0)."""
    ap = argparse.ArgumentParser(prog="mpidist tune", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="allreduce-table.json",
                    help="the table file to write (default allreduce-table.json)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, type=parse_sizes,
                    help=f"the ladder of message sizes in bytes (default {DEFAULT_SIZES})")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds per size (default 5)")
    ap.add_argument("--refit", action="store_true",
                    help="probe the cost model afresh (and cache it) instead of loading it")
    ap.add_argument("--probe-sizes", type=parse_sizes, default=None,
                    help="probe the cost model afresh at these sizes only (not cached)")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="simulate nodes of this many ranks (default: real topology)")
    args = ap.parse_args(argv)
    if args.reps < 1 or not args.sizes or min(args.sizes) < 4:
        ap.error("--reps must be >= 1 and every size >= 4 bytes")
    c = Communicator(ranks_per_node=args.ranks_per_node)
    t0 = time.perf_counter()
    if args.probe_sizes:
        model = costmodel.probe(c, sizes=args.probe_sizes)
    else:
        model = costmodel.get_model(c, refit=args.refit)
    entry = tune(c, model, args.sizes, args.reps)
    if c.rank == 0:
        made = {"by": "mpidist tune", "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                "mpi": mpi_library(), "seconds": round(time.perf_counter() - t0, 1),
                "reps": args.reps}
        write_table(args.out, entry, made)
        print(f"# {mpi_library()}; {c.describe()}")
        print(f"{'size':>8} {'pick':>19} {'model':>19} {'rule':>12}  timed (us)")
        for m in entry["measured"]:
            timed = ", ".join(f"{a} {t:.1f}" for a, t in sorted(m["us"].items(),
                                                                  key=lambda kv: kv[1]))
            print(f"{format_size(m['bytes']):>8} {m['pick']:>19} {m['model']:>19} "
                  f"{m['rule']:>12}  {timed}")
        rows = ", ".join(f"{r['algorithm']} to {r['upto']}" if r["upto"] else
                         f"{r['algorithm']} beyond" for r in entry["sizes"])
        print(f"wrote {args.out}: {rows}", flush=True)
    c.free()
    return 0
