"""`mpidist bench allreduce`: a size sweep of every allreduce algorithm beside the MPI
library's own MPI_Allreduce, in the manner of nccl-tests and the OSU benchmarks.

    python -m mpidist.launcher -n 4 -- mpidist bench allreduce
    python -m mpidist.launcher -n 4 -- mpidist bench allreduce --sizes 8,4K,1M,64M --reps 5
    MPIDIST_RANKS_PER_NODE=2 python -m mpidist.launcher -n 4 -- mpidist bench allreduce

For each size (bytes of float32) and algorithm: time of one allreduce (median over the
repetitions of the slowest rank's time, after a warm-up; the algorithms take turns in
each repetition, in a rotating order, so other load on the machine hits them alike), algbw = size / time and
busbw = algbw * 2 (p-1) / p, the bandwidth each link actually carries, comparable across
rank counts. "auto" is the cost model's choice (shown in brackets), from a model probed
afresh at the start (--no-refit keeps the cached one); "model us" is its prediction for
each algorithm. "textbook" is the 20-line blocking Sendrecv ring, the reference point of
the issue. Every call goes through the public allreduce() and its result is checked.
Writes allreduce.csv, allreduce.json and allreduce.png under --out (rank 0).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import textwrap
import time

import numpy as np
from mpi4py import MPI

__all__ = ["main", "textbook_ring"]

DEFAULT_SIZES = "8,64,512,4K,32K,256K,1M,4M,16M,64M,256M"


def textbook_ring(comm, x) -> None:
    """The textbook ring: blocking Sendrecv, reduce-scatter then allgather, in place."""
    mpi, p, r = comm.comm, comm.size, comm.rank
    counts = [len(x) // p + (i < len(x) % p) for i in range(p)]
    starts = np.concatenate([[0], np.cumsum(counts)])
    part = [x[starts[i]:starts[i + 1]] for i in range(p)]
    tmp = np.empty(max(counts), x.dtype)
    right, left = (r + 1) % p, (r - 1) % p
    for t in range(p - 1):
        s, q = (r - t) % p, (r - t - 1) % p
        mpi.Sendrecv(part[s], right, 0, tmp[:counts[q]], left, 0)
        np.add(part[q], tmp[:counts[q]], out=part[q])
    for t in range(p - 1):
        s, q = (r - t + 1) % p, (r - t) % p
        mpi.Sendrecv(part[s], right, 0, part[q], left, 0)


def _parse(argv):
    from mpidist.collectives import ALGORITHMS
    from mpidist.collectives.select import parse_size
    p = argparse.ArgumentParser(prog="mpidist bench allreduce",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"message sizes in bytes (K/M/G suffixes; default {DEFAULT_SIZES})")
    every = ["native", "textbook", *(a for a in ALGORITHMS if a != "native"), "auto"]
    p.add_argument("--algorithms", default=",".join(every),
                   help=f"algorithms to run (default: {','.join(every)})")
    p.add_argument("--reps", type=int, default=20,
                   help="timed repetitions per point at most (fewer for large sizes)")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="time budget per point (size x algorithm), which caps the repetitions")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="simulate nodes of this many ranks (default: real topology)")
    p.add_argument("--no-refit", dest="refit", action="store_false",
                   help="use the cached cost model instead of probing this machine afresh")
    p.add_argument("--out", default=os.path.join("results", "bench", "allreduce"),
                   help="output directory")
    args = p.parse_args(argv)
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in args.algorithms if a not in every]
    if bad:
        p.error(f"unknown algorithm(s) {bad}; choose from {', '.join(every)}")
    if args.reps < 1 or any(s < 4 for s in args.sizes):
        p.error("--reps must be >= 1 and every size >= 4 bytes (one float32)")
    return args


def _time_size(comm, algorithms, x: np.ndarray, reps: int, seconds: float):
    """{algorithm: (median seconds, result ok)} and the repetitions, for one size.

    After one checked warm-up call each, the algorithms take turns, repetition by
    repetition, so a burst of other load on the machine hits them alike. Repetitions are
    capped so the size takes about `seconds` per algorithm."""
    from mpidist.collectives import allreduce

    def once(alg):
        x[...] = 1.0
        comm.comm.Barrier()
        t0 = time.perf_counter()
        if alg == "textbook":
            textbook_ring(comm, x)
        else:
            allreduce(x, algorithm=alg, comm=comm)
        return time.perf_counter() - t0

    first, ok = [], []
    for alg in algorithms:
        first.append(once(alg))
        ok.append(bool(x[0] == comm.size and x[-1] == comm.size))
    first = comm.comm.allreduce(sum(first), op=MPI.MAX)
    ok = np.array(ok, np.int32)
    comm.comm.Allreduce(MPI.IN_PLACE, ok, MPI.MIN)          # checked on every rank
    n = max(1, min(reps, int(seconds * len(algorithms) / max(first, 1e-9))))
    m = len(algorithms)
    times = np.empty((n, m))
    for i in range(n):                  # the order rotates, so none always follows another
        for j in [(i + k) % m for k in range(m)]:
            times[i, j] = once(algorithms[j])
    comm.comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    return {a: (float(np.median(times[:, j])), bool(ok[j])) for j, a in enumerate(algorithms)}, n


def _plot(rows, path: str, title: str) -> None:
    import matplotlib
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
        ax.set_xlabel("message size (bytes, float32)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax2.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 150), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from mpidist.collectives.costmodel import get_model
    from mpidist.collectives.select import format_size
    from mpidist.comm import Communicator, mpi_library
    args = _parse(argv)
    c = Communicator(ranks_per_node=args.ranks_per_node)
    p = c.size
    model = get_model(c, refit=args.refit)        # probed now: auto fits this machine's state
    library = "".join(ch for ch in mpi_library() if ch.isprintable())
    header = (f"mpidist bench allreduce: {library}; {c.describe()}; float32; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if c.rank == 0:
        print(header)
        print(f"{'size':>8} {'algorithm':>26} {'time us':>12} {'algbw GB/s':>11} "
              f"{'busbw GB/s':>11} {'vs native':>9} {'model us':>10} {'error':>6} {'reps':>5} "
              f"{'check':>5}", flush=True)
    rows = []
    for nbytes in args.sizes:
        x = np.ones(nbytes // 4, np.float32)
        native_bw = None
        timed, n = _time_size(c, args.algorithms, x, args.reps, args.seconds)
        if "native" in timed:
            t = timed["native"][0]
            native_bw = x.nbytes / t / 1e9 * (2 * (p - 1) / p if p > 1 else 1)
        for alg in args.algorithms:
            t, ok = timed[alg]
            algbw = x.nbytes / t / 1e9
            busbw = algbw * 2 * (p - 1) / p if p > 1 else algbw
            pick = model.choose(x.nbytes) if alg == "auto" else alg
            label = f"auto [{pick}]" if alg == "auto" else alg
            pred = model.predict(pick, x.nbytes) if pick in model.candidates() else None
            row = {"bytes": x.nbytes, "algorithm": alg, "label": label, "time_us": t * 1e6,
                   "algbw_GBps": algbw, "busbw_GBps": busbw, "reps": n, "ok": ok,
                   "vs_native": busbw / native_bw if native_bw else None,
                   "model_us": pred * 1e6 if pred is not None else None,
                   "model_error": (pred - t) / t if pred is not None else None}
            rows.append(row)
            if c.rank == 0:
                vs = f"{row['vs_native']:.2f}x" if row["vs_native"] else "-"
                mod = f"{pred * 1e6:10.1f} {row['model_error']:+6.0%}" if pred is not None \
                    else f"{'-':>10} {'-':>6}"
                print(f"{format_size(x.nbytes):>8} {label:>26} {t * 1e6:12.1f} {algbw:11.3f} "
                      f"{busbw:11.3f} {vs:>9} {mod} {n:5d} {'ok' if ok else 'WRONG':>5}",
                      flush=True)
        del x
    if c.rank == 0:
        _summary(rows, p)
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, "allreduce")
        with open(base + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        with open(base + ".json", "w") as f:
            json.dump({"header": header, "ranks": p, "nodes": c.num_nodes, "rows": rows}, f,
                      indent=1)
        _plot(rows, base + ".png", header)
        print(f"wrote {base}.csv, .json, .png")
    ok = all(r["ok"] for r in rows)
    c.free()
    return 0 if ok else 1


def _summary(rows, p: int) -> None:
    """The issue's targets, read off this run."""
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
            line += f"; auto {by[s, 'auto']['time_us'] / best['time_us']:.2f}x best time"
        errs = [abs(by[s, a]["model_error"]) for a in own + ["native"]
                if (s, a) in by and by[s, a]["model_error"] is not None]
        if errs and s >= (64 << 10):
            line += f"; model error max {max(errs):.0%}"
        if (s, "textbook") in by and own:
            top = min((by[s, a] for a in own if (s, a) in by), key=lambda r: r["time_us"])
            line += f"; vs textbook {by[s, 'textbook']['time_us'] / top['time_us']:.2f}x"
        print(line)
