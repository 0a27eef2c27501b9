"""`mpidist bench allreduce`: a size sweep of every allreduce algorithm beside the MPI
library's own MPI_Allreduce, in the manner of nccl-tests and the OSU benchmarks.

    python -m mpidist.launcher -n 4 -- mpidist bench allreduce --sizes 8,4K,1M,64M --reps 5
    python -m mpidist.launcher -n 2 -- mpidist bench allreduce --dtype float16
    python -m mpidist.launcher -n 4 -- mpidist bench allreduce --table allreduce-table.json
    mpidist bench allreduce --cluster 2x1 --bandwidth 1gbit --sizes 4M,16M   # simulated nodes

Per size and algorithm, through the public allreduce() with its result checked: the median
over interleaved rounds (order shuffled per round) of the slowest rank's time, its spread,
algbw and busbw = algbw * 2(p-1)/p; "auto" with the algorithm it ran; "textbook", the blocking ring every algorithm is held against. The
machine's own drift (bench.steadiness) is sampled around each size. Writes allreduce.csv,
.json and .png under --out (rank 0). See docs/PERFORMANCE.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time

import ml_dtypes
import numpy as np
from mpi4py import MPI

from mpidist.bench._driver import (add_cluster_options, launched, on_cluster,
                                   without_cluster_options)
from mpidist.bench.rows import write_rows
from mpidist.bench.steadiness import Steadiness
from mpidist.collectives import ALGORITHMS, allreduce, flight, select
from mpidist.collectives.core import prepare_allreduce
from mpidist.collectives.ops import accumulator_dtype
from mpidist.collectives.tuning.timing import STATE_TOLERANCE, state_held, time_calls
from mpidist.comm import Communicator, mpi_library
from mpidist.partition import chunk
from mpidist.sizes import format_size, parse_sizes

__all__ = ["main", "textbook_ring"]

DEFAULT_SIZES = "8,64,512,4K,32K,256K,1M,4M,16M,64M,256M"
MIN_ROUNDS = 15
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16), "float64": np.dtype(np.float64),
          "int32": np.dtype(np.int32), "int64": np.dtype(np.int64)}


def textbook_ring(comm, x) -> None:
    """The textbook ring: blocking Sendrecv, reduce-scatter then allgather, in place, in
    x's own dtype (messages move as raw bits: MPI has no half precision types)."""
    mpi, p, r = comm.comm, comm.size, comm.rank
    part = [x[o:o + c] for o, c in (chunk(len(x), i, p) for i in range(p))]
    bits = [v.view(f"u{x.itemsize}") for v in part]
    tmp = np.empty(len(part[0]), x.dtype)
    right, left = (r + 1) % p, (r - 1) % p
    for t in range(p - 1):
        s, q = (r - t) % p, (r - t - 1) % p
        got = tmp[:len(part[q])]
        mpi.Sendrecv(bits[s], right, 0, got.view(bits[s].dtype), left, 0)
        np.add(part[q], got, out=part[q])
    for t in range(p - 1):
        s, q = (r - t + 1) % p, (r - t) % p
        mpi.Sendrecv(bits[s], right, 0, bits[q], left, 0)


def _parse(argv):
    p = argparse.ArgumentParser(prog="mpidist bench allreduce",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, type=parse_sizes,
                   help=f"message sizes in bytes (K/M/G suffixes; default {DEFAULT_SIZES})")
    every = ["native", "textbook", *(a for a in ALGORITHMS if a != "native"), "auto"]
    p.add_argument("--algorithms", default=",".join(every),
                   help=f"algorithms to run (default: {','.join(every)})")
    p.add_argument("--reps", type=int, default=2000,
                   help=f"timed rounds per size at most (fewer for large sizes, at least "
                        f"{MIN_ROUNDS})")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="time budget per point (size x algorithm), which caps the rounds")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the shuffled order within each round (rank 0's is used)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="element type (default float32)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="simulate nodes of this many ranks (default: real topology)")
    p.add_argument("--table", default=None,
                   help="auto's decision table (default: env MPIDIST_ALGORITHM_TABLE, else the "
                        "built-in rule)")
    p.add_argument("--out", default=os.path.join("results", "bench", "allreduce"),
                   help="output directory")
    add_cluster_options(p)
    args = p.parse_args(argv)
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in args.algorithms if a not in every]
    if bad:
        p.error(f"unknown algorithm(s) {bad}; choose from {', '.join(every)}")
    if args.reps < 1 or any(s < 4 for s in args.sizes):
        p.error("--reps must be >= 1 and every size >= 4 bytes")
    args.dtype = DTYPES[args.dtype]
    return args


def _time_size(comm, algorithms, x: np.ndarray, reps: int, seconds: float, seed: int):
    """{algorithm: (seconds per round, result ok)} and the rounds, for one size: one checked
    warm-up call each, then interleaved rounds (timing.time_calls), as many as fit in about
    `seconds` per algorithm, at least MIN_ROUNDS, at most reps."""

    def call(alg):
        if alg == "textbook":
            return lambda: textbook_ring(comm, x)
        return lambda: allreduce(x, algorithm=alg, comm=comm)

    ok = np.array([0] * len(algorithms), np.int32)

    def check(alg):
        ok[algorithms.index(alg)] = x[0] == comm.size and x[-1] == comm.size

    times = time_calls(comm, {alg: call(alg) for alg in algorithms}, reps=None,
                       seconds=seconds * len(algorithms), min_reps=MIN_ROUNDS,
                       max_reps=reps, seed=seed,
                       setup=lambda: x.fill(1.0), warmed=check)
    comm.comm.Allreduce(MPI.IN_PLACE, ok, MPI.MIN)          # checked on every rank
    return {a: (times[a], bool(ok[j])) for j, a in enumerate(algorithms)}, \
        len(times[algorithms[0]])


def _dispatch_cost(comm, nbytes: int, calls: int = 20000) -> dict:
    """Seconds per call, slowest rank, of auto's decision lookup (select.choose) and of
    the whole argument check with "auto" and with "native" (prepare_allreduce)."""
    x = np.ones(max(1, nbytes // 4), np.float32)
    probes = {"choose": lambda: select.choose(comm, nbytes),
              "prepare_auto": lambda: flight.end(prepare_allreduce(comm, x, "sum", "auto", None)[-1]),
              "prepare_native": lambda: flight.end(prepare_allreduce(comm, x, "sum", "native", None)[-1])}
    out = {}
    for name, fn in probes.items():
        fn()                                   # the guard sees the signature once
        best = np.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls)
        out[name] = comm.comm.allreduce(best, op=MPI.MAX)
    return out


def _plot(rows, path: str, title: str) -> None:
    import matplotlib                  # heavy, and only rank 0 plots
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for alg in dict.fromkeys(r["algorithm"] for r in rows):
        pts = [r for r in rows if r["algorithm"] == alg]
        style = dict(lw=2.2, color="black") if alg == "native" else \
            dict(ls="--") if alg in ("auto", "textbook") else {}
        ax1.plot([r["bytes"] for r in pts], [r["time_us"] for r in pts], marker="o", ms=3,
                 label=alg, **style)
        ax2.plot([r["bytes"] for r in pts], [r["busbw_GBps"] for r in pts], marker="o", ms=3,
                 label=alg, **style)
    for ax, ylabel in ((ax1, "time per allreduce (us)"), (ax2, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax2.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 150), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.cluster and not launched():     # this command again, on the simulated cluster
        rest = without_cluster_options(sys.argv[1:] if argv is None else argv)
        return on_cluster(args, [sys.executable, "-m", "mpidist", "bench", "allreduce",
                                 *rest]).returncode
    if args.table:
        select.use_table(args.table)
    c = Communicator(ranks_per_node=args.ranks_per_node)
    p = c.size
    seed = c.comm.bcast(args.seed, root=0)
    load = os.getloadavg()[0]
    dispatch = _dispatch_cost(c, 4096)
    library = "".join(ch for ch in mpi_library() if ch.isprintable())
    header = (f"mpidist bench allreduce: {library}; {c.describe()}; {args.dtype}; "
              f"load average {load:.1f} on {os.cpu_count()} cores; auto dispatch "
              f"{dispatch['choose'] * 1e9:.0f} ns lookup, "
              f"{(dispatch['prepare_auto'] - dispatch['prepare_native']) * 1e9:+.0f} ns "
              f"vs an explicit algorithm's argument check; auto: {select.describe(c)}")
    if c.rank == 0:
        print(header)
        print(f"{'size':>8} {'algorithm':>26} {'time us':>12} {'spread':>7} {'algbw GB/s':>11} "
              f"{'busbw GB/s':>11} {'vs native':>9} {'reps':>5} "
              f"{'check':>5}", flush=True)
    steadiness = Steadiness(c.comm)
    steadiness.sample()
    rows = []
    for k, nbytes in enumerate(args.sizes):
        x = np.ones(max(1, nbytes // args.dtype.itemsize), args.dtype)
        reduced = x.size * accumulator_dtype(x.dtype).itemsize    # the bytes auto judges
        native_bw = None
        timed, n = _time_size(c, args.algorithms, x, args.reps, args.seconds, seed + k)
        paired = _auto_vs_best_paired(timed)
        if "native" in timed:
            t = float(np.median(timed["native"][0]))
            native_bw = x.nbytes / t / 1e9 * (2 * (p - 1) / p if p > 1 else 1)
        for alg in args.algorithms:
            samples, ok = timed[alg]
            t = float(np.median(samples))
            q1, q3 = np.percentile(samples, [25, 75])
            algbw = x.nbytes / t / 1e9
            busbw = algbw * 2 * (p - 1) / p if p > 1 else algbw
            pick = select.choose(c, reduced) if alg == "auto" else alg
            label = f"auto [{pick}]" if alg == "auto" else alg
            row = {"bytes": x.nbytes, "algorithm": alg, "label": label, "time_us": t * 1e6,
                   "p25_us": q1 * 1e6, "p75_us": q3 * 1e6, "spread": (q3 - q1) / t,
                   "algbw_GBps": algbw, "busbw_GBps": busbw, "reps": n, "ok": ok,
                   "vs_native": busbw / native_bw if native_bw else None,
                   "vs_best_paired": paired if alg == "auto" else None,
                   "pick": pick}
            rows.append(row)
            if c.rank == 0:
                vs = f"{row['vs_native']:.2f}x" if row["vs_native"] else "-"
                print(f"{format_size(x.nbytes):>8} {label:>26} {t * 1e6:12.1f} "
                      f"{row['spread']:6.0%} {algbw:11.3f} {busbw:11.3f} {vs:>9} "
                      f"{n:5d} {'ok' if ok else 'WRONG':>5}", flush=True)
        del x
        steadiness.sample()
        around = steadiness.state_samples[-2:]          # before and after this size
        for row in rows[-len(args.algorithms):] if around else []:
            row["state_around_s"] = around
    if c.rank == 0:
        _summary(rows, p)
        print(f"  {steadiness.line()}")
        base = write_rows(args.out, "allreduce", rows, {
            "header": header, "ranks": p, "nodes": c.num_nodes, "seed": seed,
            "load_before": load, "load_after": os.getloadavg()[0], "dispatch_s": dispatch,
            "steadiness": steadiness.summary(), "auto": select.describe(c)})
        _plot(rows, base + ".png", header)
        print(f"wrote {base}.csv, .json, .png")
    ok = all(r["ok"] for r in rows)
    c.free()
    return 0 if ok else 1


def _auto_vs_best_paired(timed: dict) -> float | None:
    """Median over rounds of auto's time over the best candidate's (lowest median) in the
    same round: a drift of the machine's speed between rounds cancels."""
    cands = [a for a in timed if a not in ("auto", "textbook")]
    if "auto" not in timed or not cands:
        return None
    best = min(cands, key=lambda a: np.median(timed[a][0]))
    return float(np.median(timed["auto"][0] / timed[best][0]))


def _state_held(row: dict) -> bool:
    """Whether the machine state stayed within STATE_TOLERANCE across this row's size."""
    return state_held(row.get("state_around_s") or (1.0,))


def _summary(rows, p: int) -> None:
    """Per size: the best algorithm, mpidist's best against native and the textbook ring,
    auto against the best, read off this run."""
    by = {(r["bytes"], r["algorithm"]): r for r in rows}
    sizes = sorted({r["bytes"] for r in rows})
    own = [a for a in dict.fromkeys(r["algorithm"] for r in rows)
           if a not in ("native", "textbook", "auto")]
    print("summary:")
    for s in sizes:
        cands = [by[s, a] for a in own + ["native"] if (s, a) in by]
        if not cands:
            continue
        best = min(cands, key=lambda r: r["time_us"])
        line = f"  {s:>10} B: best {best['algorithm']} {best['busbw_GBps']:.3f} GB/s"
        if (s, "native") in by:
            mine = [by[s, a] for a in own if (s, a) in by]
            if mine:
                top = min(mine, key=lambda r: r["time_us"])
                line += (f"; best mpidist {top['algorithm']} "
                         f"{by[s, 'native']['time_us'] / top['time_us']:.2f}x native busbw")
        if (s, "auto") in by:
            auto = by[s, "auto"]
            notes = ""
            if auto["pick"] == best["algorithm"]:
                notes += "; auto ran the best itself: the gap is its dispatch and the " \
                    "sweep's noise"
            if not _state_held(auto):
                before, after = auto["state_around_s"]
                notes += f"; the machine state moved {after / before:.2f}x during this size"
            line += (f"; auto {auto['time_us'] / best['time_us']:.2f}x best time "
                     f"({auto['vs_best_paired']:.2f}x paired{notes})")
        if (s, "textbook") in by and own:
            top = min((by[s, a] for a in own if (s, a) in by), key=lambda r: r["time_us"])
            line += f"; vs textbook {by[s, 'textbook']['time_us'] / top['time_us']:.2f}x"
        print(line)
    if (4096, "native") in by:
        ratios = ", ".join(f"{a} {by[4096, a]['time_us'] / by[4096, 'native']['time_us']:.2f}x"
                           for a in own if (4096, a) in by)
        print(f"  4 KiB latency vs native (target <= 3x): {ratios}")
    autos = [(by[s, "auto"]["time_us"] / min(by[s, a]["time_us"] for a in own + ["native"]
                                             if (s, a) in by), s)
             for s in sizes if (s, "auto") in by and any((s, a) in by for a in own + ["native"])]
    if autos:
        worst = max(autos)
        paired = max((by[s, "auto"]["vs_best_paired"], s) for _, s in autos)
        line = (f"  auto vs best (target <= 1.10x), the median of per-round ratios (the "
                f"machine's drift between rounds cancels): worst {paired[0]:.2f}x at "
                f"{paired[1]} B; as a ratio of medians: worst {worst[0]:.2f}x at {worst[1]} B")
        # a state that moved during a size may have changed which algorithm is best
        held = [(ratio, s) for ratio, s in autos if _state_held(by[s, "auto"])]
        if held and len(held) < len(autos):
            w = max(held)
            line += (f"; at the {len(held)} of {len(autos)} sizes where the machine state held "
                     f"(within {STATE_TOLERANCE - 1:.0%}, before and after): worst {w[0]:.2f}x "
                     f"at {w[1]} B")
        print(line)
