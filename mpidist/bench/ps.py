"""`mpidist bench ps`: the parameter server against raw RMA and against ring allreduce.

    python -m mpidist.launcher -n 4 -- mpidist bench ps
    python -m mpidist.launcher -n 4 -- mpidist bench ps --mb 1 --iters 20 --servers 2

What it measures, and how: main()'s docstring. See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from mpidist.bench.rows import write_rows
from mpidist.collectives import allreduce
from mpidist.comm import Communicator, default_communicator, mpi_library
from mpidist.ps import ParameterServer, Straggler

__all__ = ["main", "first_ranks"]


def _parse(argv):
    p = argparse.ArgumentParser(prog="mpidist bench ps", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=1.0, help="shard / model size in MiB (float32)")
    p.add_argument("--iters", type=int, default=30, help="timed push+pull iterations / steps")
    p.add_argument("--servers", type=int, default=2, help="S of the multi-server rows")
    p.add_argument("--steps", type=int, default=100, help="steps of the straggler runs")
    p.add_argument("--delay", type=float, default=0.01, help="straggler delay per step (s)")
    p.add_argument("--compute", type=float, default=0.002, help="simulated compute per step (s)")
    p.add_argument("--staleness", type=int, default=2, help="SSP bound of the straggler runs")
    p.add_argument("--out", default=os.path.join("results", "bench", "ps"), help="output directory")
    args = p.parse_args(argv)
    if args.mb <= 0 or args.iters < 2 or args.servers < 1:
        p.error("--mb must be > 0, --iters >= 2, --servers >= 1")
    return args


def _ping_pong(comm: MPI.Comm, nbytes: int, reps: int) -> float:
    """One-way time of an nbytes message between ranks 0 and 1 (the others wait)."""
    buf = np.zeros(max(nbytes, 1), np.uint8)
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        if comm.rank == 0:
            comm.Send(buf, 1)
            comm.Recv(buf, 1)
        elif comm.rank == 1:
            comm.Recv(buf, 0)
            comm.Send(buf, 0)
    return comm.bcast((time.perf_counter() - t0) / (2 * reps), root=0)


def _rma_get(comm: MPI.Comm, nbytes: int, reps: int) -> float:
    """Time of a Get + Flush of nbytes by rank 0 from the last rank (the others wait)."""
    target = comm.size - 1
    win = MPI.Win.Allocate(nbytes if comm.rank == target else 0, 1, comm=comm)
    try:
        buf = np.zeros(nbytes, np.uint8)
        win.Lock_all(MPI.MODE_NOCHECK)
        comm.Barrier()
        t0 = time.perf_counter()
        if comm.rank == 0:
            for _ in range(reps):
                win.Get(buf, target)
                win.Flush(target)
        dt = (time.perf_counter() - t0) / reps
        comm.Barrier()
        win.Unlock_all()
    finally:
        win.Free()
    return comm.bcast(dt, root=0)


def _alpha_beta(timer, comm: MPI.Comm, nbytes: int) -> tuple[float, float]:
    """alpha (s) from 8-byte transfers, beta (s/byte) from nbytes transfers."""
    alpha = timer(comm, 8, 200)
    big = timer(comm, nbytes, 20)
    return alpha, max(big - alpha, 1e-15) / nbytes


def _raw_loop(comm: MPI.Comm, n: int, iters: int) -> float | None:
    """Median seconds per Accumulate+Get of n floats on the last rank (None on that rank)."""
    server = comm.size - 1
    me = comm.rank
    win = MPI.Win.Allocate(n * 4 if me == server else 0, 4, comm=comm)
    times = []
    try:
        win.Lock_all(MPI.MODE_NOCHECK)
        comm.Barrier()
        if me != server:
            g, out = np.ones(n, np.float32), np.empty(n, np.float32)
            for _ in range(iters + 1):
                t0 = time.perf_counter()
                win.Accumulate(g, server, op=MPI.SUM)
                win.Flush(server)
                win.Get(out, server)
                win.Flush(server)
                times.append(time.perf_counter() - t0)
        comm.Barrier()
        win.Unlock_all()
    finally:
        win.Free()
    return float(np.median(times[1:])) if times else None


def _ps_loop(comm, n: int, iters: int, servers: int, consistency: str) -> float | None:
    """Median seconds per pull+push of n floats through the parameter server (workers)."""
    times = []
    with ParameterServer(np.zeros(n, np.float32), comm=comm, servers=servers,
                         consistency=consistency, average=False, timeout=120) as ps:
        if ps.is_server:
            ps.serve()
        else:
            g, out = np.ones(n, np.float32), np.empty(n, np.float32)
            for _ in range(iters + 1):
                t0 = time.perf_counter()
                ps.worker.pull(out=out)
                ps.worker.push(g)
                times.append(time.perf_counter() - t0)
            ps.worker.finish()
    return float(np.median(times[1:])) if times else None


def _straggler_run(comm, n: int, args, consistency: str, straggler) -> float | None:
    """Seconds until --steps steps' worth of updates are applied (workers; None on servers)."""
    staleness = args.staleness if consistency == "ssp" else None
    with ParameterServer(np.zeros(n, np.float32), comm=comm, consistency=consistency,
                         staleness=staleness, straggler=straggler, average=False,
                         timeout=120) as ps:
        if ps.is_server:
            ps.serve()
            return None
        w, g, out = ps.worker, np.ones(n, np.float32), np.empty(n, np.float32)
        t0 = time.perf_counter()
        while True:
            w.pull(out=out)
            time.sleep(args.compute)
            w.push(g)
            if (w.clock if consistency == "bsp" else w.global_clock()) >= args.steps:
                break
        w.finish()
        w.pull_final(out=out)
        return time.perf_counter() - t0


def _ring_loop(comm, n: int, iters: int) -> float:
    x = np.ones(n, np.float32)
    times = []
    for _ in range(iters + 1):
        comm.comm.Barrier()
        t0 = time.perf_counter()
        allreduce(x, algorithm="ring", comm=comm)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def _slowest(comm: MPI.Comm, value: float | None) -> float:
    return max(v for v in comm.allgather(value) if v is not None)


def first_ranks(world, members: int):
    """Collective on world: a Communicator over its ranks [0, members), None on the others."""
    mpi = world.comm.Split(0 if world.rank < members else MPI.UNDEFINED, world.rank)
    if mpi == MPI.COMM_NULL:
        return None
    sub = Communicator(mpi)
    mpi.Free()
    return sub


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code.

      1. throughput: one server rank holds a --mb MiB shard; every other rank is a worker that
         pushes and pulls it --iters times (ASP, the servers sum the pushes), against the same
         MPI library's raw loop of Accumulate + Flush + Get + Flush on a plain Win.Allocate
         window of the same size, in the same run (three alternating rounds, median of the
         rounds' medians). Target: parameter-server time within 2x.
      2. scaling: for p = 1.. workers, the per-step communication time of a BSP step (push +
         pull of a --mb MiB model) with 1 server and with --servers servers, and of a ring
         allreduce of the same model over p ranks, beside alpha-beta predictions (alpha, beta
         measured with RMA Get for the servers, with a ping-pong for the ring): one server moves 2pn bytes per step (T = 2a + 2pn b), S servers
         2pn/S each (T = 2a + 2pn b / S), the ring 2(p-1)n/p per rank (T = 2(p-1)a + 2(p-1)n b / p).
      3. stragglers: time until the servers have applied --steps steps' worth of updates
         (BSP: every worker makes every step; ASP/SSP: workers stop when the servers' applied
         pushes reach steps x W), with simulated compute (--compute s of sleep per step) and a
         --delay s straggler, persistent (the last worker) or rotating (a random worker per step).
    Writes ps.csv, ps.json and ps.png under --out (rank 0). Step time = slowest worker's median.
    """
    args = _parse(argv)
    world = default_communicator()
    P = world.size
    if P < 2:
        print("mpidist bench ps needs at least 2 ranks (a server and a worker)")
        return 2
    n = int(args.mb * 2**20) // 4
    nbytes = 4 * n
    root = world.rank == 0
    library = "".join(ch for ch in mpi_library() if ch.isprintable())
    header = (f"{library}; {P} ranks on {world.num_nodes} node(s); {args.mb:g} MiB; "
              f"{args.iters} iterations")
    if root:
        print(header)

    # 1. throughput: parameter server vs raw Accumulate + Get, 1 server, P - 1 workers
    raws, pss = [], []
    for _ in range(3):                      # alternate, so both see the same machine load
        raws.append(_slowest(world.comm, _raw_loop(world.comm, n, args.iters)))
        pss.append(_slowest(world.comm, _ps_loop(world, n, args.iters, 1, "asp")))
    raw, ps = float(np.median(raws)), float(np.median(pss))
    W = P - 1
    through = {"raw_s": raw, "ps_s": ps, "ratio": ps / raw,
               "raw_MBps": 2 * W * nbytes / raw / 1e6, "ps_MBps": 2 * W * nbytes / ps / 1e6}
    if root:
        print(f"\n1. push+pull of a {args.mb:g} MiB shard, 1 server, {W} workers (slowest worker, "
              f"median; rounds: raw {[round(t * 1e3, 3) for t in raws]} ms, "
              f"ps {[round(t * 1e3, 3) for t in pss]} ms)")
        print(f"   raw Accumulate+Get   {raw * 1e3:9.3f} ms   {through['raw_MBps']:9.1f} MB/s aggregate")
        print(f"   parameter server     {ps * 1e3:9.3f} ms   {through['ps_MBps']:9.1f} MB/s aggregate")
        print(f"   ratio {through['ratio']:.2f}x (target <= 2x): "
              f"{'met' if through['ratio'] <= 2 else 'NOT met'}")

    # 2. scaling with the worker count
    a_rma, b_rma = _alpha_beta(_rma_get, world.comm, nbytes)      # the servers move data by RMA
    a_p2p, b_p2p = _alpha_beta(_ping_pong, world.comm, nbytes)    # the ring by send/receive
    rows = []
    for p in range(1, P):
        row = {"workers": p}
        variants = [("ps_1", 1, p + 1), ("ps_S", args.servers, p + args.servers), ("ring", 0, p)]
        for name, S, members in variants:
            if members > P or (name == "ps_S" and args.servers == 1):
                row[name] = None
                continue
            sub = first_ranks(world, members)
            t = None
            if sub is not None:
                t = _ring_loop(sub, n, args.iters) if name == "ring" else \
                    _ps_loop(sub, n, args.iters, S, "bsp")
                sub.free()
            row[name] = _slowest(world.comm, t)
        S = args.servers
        row["pred_ps_1"] = 2 * a_rma + 2 * p * nbytes * b_rma
        row["pred_ps_S"] = 2 * a_rma + 2 * p * nbytes * b_rma / S
        row["pred_ring"] = 2 * (p - 1) * a_p2p + 2 * (p - 1) * nbytes * b_p2p / p
        rows.append(row)
    # 3. stragglers: persistent vs rotating, under each consistency model
    strag = []
    for model in ("bsp", "asp", "ssp"):
        row = {"model": model if model != "ssp" else f"ssp({args.staleness})"}
        for kind, who in (("persistent", P - 2), ("rotating", None)):
            t = _straggler_run(world, 4096, args, model, Straggler(worker=who, delay=args.delay))
            row[kind] = _slowest(world.comm, t)
        strag.append(row)

    if root:
        ms = lambda v: "      -" if v is None else f"{v * 1e3:7.3f}"
        print(f"\n2. per-step communication time (ms) of a {args.mb:g} MiB model; alpha-beta "
              f"from RMA Get: {a_rma * 1e6:.1f} us, {1 / b_rma / 1e9:.2f} GB/s; from ping-pong: "
              f"{a_p2p * 1e6:.1f} us, {1 / b_p2p / 1e9:.2f} GB/s")
        print(f"   {'p':>3} | {'1 server':>7} {'pred':>7} | {f'{S} servers':>9} {'pred':>7} | "
              f"{'ring':>7} {'pred':>7}")
        for r in rows:
            print(f"   {r['workers']:>3} | {ms(r['ps_1'])} {ms(r['pred_ps_1'])} | "
                  f"{ms(r['ps_S']):>9} {ms(r['pred_ps_S'])} | {ms(r['ring'])} {ms(r['pred_ring'])}")
        print(f"\n3. stragglers: seconds to {args.steps} steps' worth of updates, 1 server, {W} "
              f"workers, {args.compute * 1e3:g} ms compute + {args.delay * 1e3:g} ms delay")
        print(f"   {'model':>7} | {'persistent':>10} | {'rotating':>8}")
        for r in strag:
            print(f"   {r['model']:>7} | {r['persistent']:10.3f} | {r['rotating']:8.3f}")
        base = write_rows(args.out, "ps", rows, {
            "header": header, "ranks": P, "mb": args.mb,
            "alpha_beta": {"rma": [a_rma, b_rma], "p2p": [a_p2p, b_p2p]},
            "throughput": through, "stragglers": strag})
        _plot(rows, base + ".png", f"{library.split(',')[0]}: {P} ranks, {args.mb:g} MiB model",
              args.servers)
        print(f"wrote {base}.csv, .json, .png")
    return 0


def _plot(rows, path: str, title: str, S: int) -> None:
    import matplotlib                  # slow to import, and only rank 0 plots
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    p = [r["workers"] for r in rows]
    for key, label, color in (("ps_1", "1 server", "C0"), ("ps_S", f"{S} servers", "C1"),
                              ("ring", "ring allreduce", "C2")):
        pts = [(x, r[key]) for x, r in zip(p, rows) if r[key] is not None]
        if pts:
            ax.plot(*zip(*[(x, y * 1e3) for x, y in pts]), "o-", color=color, label=label)
            ax.plot(p, [r["pred_" + key] * 1e3 for r in rows], "--", color=color, alpha=0.6)
    ax.set_xticks(p)
    ax.set_xlabel("workers p")
    ax.set_ylabel("communication per step (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(title="measured (solid), alpha-beta (dashed)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
