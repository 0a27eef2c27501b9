"""`mpidist tune`: measure this layout and write auto's decision table.

    python -m mpidist.launcher -n 4 -- mpidist tune --out allreduce-table.json
    srun -n 64 mpidist tune --out table.json --sizes 4K,64K,1M,16M,256M

Each pass over the ladder times, at every size, every algorithm in interleaved rounds
(timing.time_algorithms: the same numbers on every rank, as many rounds as fit in a time
budget), so that each is timed beside all the others, as a benchmark times it, at PASSES
moments of a drifting machine. `decide` picks the algorithm least behind each pass's fastest
on average; a tie (a margin within MIN_GAIN or its spread over the passes) goes to the
built-in rule's pick, then to native. A pick wins the sizes up to the geometric middle to
the next size. Rank 0 writes the table (select.FORMAT) with the timings as notes; an
existing file keeps its other layouts. Point a job at it with [parallel] algorithm_table or
env MPIDIST_ALGORITHM_TABLE. See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

from mpidist.collectives import node, select
from mpidist.collectives.registry import ALGORITHMS
from mpidist.collectives.tuning import timing
from mpidist.comm import Communicator, mpi_library
from mpidist.sizes import format_size, parse_sizes

__all__ = ["tune", "candidates", "behind", "decide", "main", "DEFAULT_SIZES", "SECONDS",
           "MIN_ROUNDS", "PASSES", "MIN_GAIN"]

# the sizes `mpidist bench allreduce` measures by default, so that each has its own row
DEFAULT_SIZES = "8,64,512,4K,32K,256K,1M,4M,16M,64M,256M"
SECONDS = 1.5         # per size and pass: the time that sets the rounds
MIN_ROUNDS = 7        # rounds per size and pass at least (at most 300)
PASSES = 3            # passes over the ladder
MIN_GAIN = 0.03       # a mean margin this small or smaller is a tie (decide)


def candidates(comm) -> list[str]:
    """The algorithms timed at every size: every registered one that can run on comm, the
    set `mpidist bench allreduce` holds auto against (hierarchical included: on one node it
    runs the ring, and timing it beside the ring shows how far two timings of one code
    differ)."""
    return [a for a in ALGORITHMS if a != "shm" or node.usable(comm)]


def behind(times: dict, names) -> dict[str, float]:
    """Per name, how far it fell behind in one pass: the median over rounds of its time
    over the time, in the same round, of the pass's fastest (by median) of names."""
    best = min(names, key=lambda a: float(np.median(times[a])))
    return {a: max(1.0, float(np.median(times[a] / times[best]))) for a in names}


def decide(passes: list[dict], incumbent: str, gain: float = MIN_GAIN) -> str:
    """The pick from each pass's `behind`: the algorithm least behind on average over the
    passes, unless it is not clearly ahead of the incumbent (the built-in rule's pick) or,
    failing that, of native: ties go to the rule, then to the MPI library's own collective.
    Clearly ahead: a mean margin larger than both `gain` and the margin's spread (its
    standard error over the passes)."""
    mean = {a: float(np.mean([b[a] for b in passes])) for a in passes[0]}
    least = min(mean, key=lambda a: (mean[a], a != incumbent, a != "native"))
    for keep in (incumbent, "native"):
        if keep in mean and not _clearly_ahead(passes, least, keep, gain):
            return keep
    return least


def _clearly_ahead(passes: list[dict], a: str, b: str, gain: float) -> bool:
    """Whether a's mean margin over b across the passes exceeds gain and its spread."""
    margins = [p[b] - p[a] for p in passes]
    spread = float(np.std(margins, ddof=1) / math.sqrt(len(margins))) if len(margins) > 1 \
        else 0.0
    return float(np.mean(margins)) > max(gain, spread)


def tune(comm, sizes, reps: int | None = None, seconds: float = SECONDS,
         passes: int = PASSES) -> dict:
    """Collective: time every algorithm at every size in `passes` passes over the ladder
    (reps rounds per size and pass, or as many as fit in `seconds`); returns the table
    entry for comm's layout (select.layout_of plus "sizes" rows and "measured" notes), the
    same on every rank."""
    sizes = sorted(sizes)
    budget = dict(reps=reps, seconds=seconds, min_reps=MIN_ROUNDS)
    rules = [select.rule(comm, n) for n in sizes]
    ns = candidates(comm) if comm.size > 1 else ["native"]
    spent, passed = [0.0] * len(sizes), [[] for _ in sizes]
    times: list[dict] = [{a: [] for a in ns} for _ in sizes]
    for p in range(passes if comm.size > 1 else 1):
        for k, n in enumerate(sizes):         # a pass: every size, then the next pass
            t0 = time.perf_counter()
            t = {"native": np.ones(1)} if comm.size == 1 else \
                timing.time_algorithms(comm, ns, n, seed=p * len(sizes) + k, **budget)
            spent[k] += time.perf_counter() - t0
            passed[k].append(behind(t, ns))
            for a in ns:
                times[k][a].extend(t[a])
    measured = []
    for n, done, t, rule, sec in zip(sizes, passed, times, rules, spent):
        pick = decide(done, rule if rule in ns else ns[0], MIN_GAIN)
        measured.append({"bytes": n, "pick": pick, "rule": rule,
                         "behind": {a: [round(b[a], 3) for b in done]
                                    for a in sorted(ns, key=lambda a: sum(b[a] for b in done))},
                         "us": {a: round(float(np.median(t[a])) * 1e6, 1) for a in ns},
                         "rounds": len(t[ns[0]]), "seconds": round(sec, 1)})
    rows = []
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
    """`mpidist tune`: time every algorithm at every size, write the table (rank 0)."""
    ap = argparse.ArgumentParser(prog="mpidist tune", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="allreduce-table.json",
                    help="the table file to write (default allreduce-table.json)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, type=parse_sizes,
                    help=f"the ladder of message sizes in bytes (default {DEFAULT_SIZES})")
    ap.add_argument("--reps", type=int, default=None,
                    help=f"timed rounds per size and pass (default: as many as fit in "
                         f"--seconds, {MIN_ROUNDS} to 300)")
    ap.add_argument("--seconds", type=float, default=SECONDS,
                    help=f"time per size and pass that sets the rounds (default {SECONDS})")
    ap.add_argument("--passes", type=int, default=PASSES,
                    help=f"the screening pass and the re-checks (default {PASSES})")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="simulate nodes of this many ranks (default: real topology)")
    args = ap.parse_args(argv)
    if (args.reps is not None and args.reps < 1) or args.seconds <= 0 or args.passes < 1 \
            or not args.sizes or min(args.sizes) < 4:
        ap.error("--reps and --passes must be >= 1, --seconds > 0, every size >= 4 bytes")
    c = Communicator(ranks_per_node=args.ranks_per_node)
    t0 = time.perf_counter()
    entry = tune(c, args.sizes, args.reps, args.seconds, args.passes)
    if c.rank == 0:
        made = {"by": "mpidist tune", "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                "mpi": mpi_library(), "seconds": round(time.perf_counter() - t0, 1),
                "reps": args.reps, "seconds_per_pass": args.seconds, "passes": args.passes}
        write_table(args.out, entry, made)
        print(f"# {mpi_library()}; {c.describe()}")
        print(f"{'size':>8} {'pick':>19} {'rule':>12} {'rounds':>6} {'s':>5}  "
              f"least behind the fastest, per pass; median (us)")
        for m in entry["measured"]:
            timed = ", ".join(f"{a} {t:.1f}" for a, t in sorted(m["us"].items(),
                                                                  key=lambda kv: kv[1]))
            held = ", ".join(f"{a} " + " ".join(f"{b:.2f}" for b in bs)
                             for a, bs in list(m["behind"].items())[:3])
            print(f"{format_size(m['bytes']):>8} {m['pick']:>19} {m['rule']:>12} "
                  f"{m['rounds']:>6} {m['seconds']:5.1f}  {held}; {timed}")
        rows = ", ".join(f"{r['algorithm']} to {r['upto']}" if r["upto"] else
                         f"{r['algorithm']} beyond" for r in entry["sizes"])
        print(f"wrote {args.out}: {rows}", flush=True)
    c.free()
    return 0
