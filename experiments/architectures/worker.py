"""Phases A and B inside the MPI job: each variant's step time and NIC bytes, then the
cost model's probe on the widest group; rank 0 prints the result for the driver."""
from __future__ import annotations

import time

import numpy as np

from experiments import common
from experiments.architectures.overlap import overlap
from experiments.architectures.p2p import p2p_allreduce


def _measure(world, subs, variant: str, members: int, servers: int, n: int, iters: int):
    """(seconds per step on the slowest rank, [tx, rx] per step of every world rank's NIC)."""
    from mpi4py import MPI
    from mpidist.collectives import allreduce
    from mpidist.ps import ParameterServer
    from mpidist.simcluster import nic_bytes
    sub = subs[members]
    seconds, before, after = None, None, None
    if sub is not None:
        x = np.ones(n, np.float32)
        out = np.empty_like(x)
        if variant == "ps":
            with ParameterServer(np.zeros(n, np.float32), comm=sub, servers=servers,
                                 average=False, timeout=300) as ps:
                before = nic_bytes()
                sub.comm.Barrier()
                t0 = time.perf_counter()
                if ps.is_server:
                    ps.serve()
                else:
                    for _ in range(iters):
                        ps.worker.pull(out=out)
                        ps.worker.push(x)
                    ps.worker.finish()
                sub.comm.Barrier()
                seconds = time.perf_counter() - t0
                after = nic_bytes()
        else:
            run = {"ring": lambda: allreduce(x, algorithm="ring", comm=sub, out=out),
                   "hierarchical": lambda: allreduce(x, algorithm="hierarchical", comm=sub, out=out),
                   "native": lambda: sub.comm.Allreduce(x, out, MPI.SUM),
                   "p2p": lambda: p2p_allreduce(sub, x, out)}[variant]
            run()                                          # warm: connections, JIT
            before = nic_bytes()
            sub.comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            sub.comm.Barrier()
            seconds = time.perf_counter() - t0
            after = nic_bytes()
    t = max(s for s in world.comm.allgather(seconds) if s is not None) / iters
    nic = None if before is None or after is None or world.local_rank != 0 else \
        [(after[0] - before[0]) / iters, (after[1] - before[1]) / iters]
    return t, world.comm.allgather(nic)


def main(spec: str) -> None:
    """Run the phase that `spec` ("phase=A,workers=4,n=...,iters=...,rounds=...,probe_s=...")
    names on COMM_WORLD's ranks."""
    from mpidist.bench.ps import first_ranks
    from mpidist.comm import Communicator
    probe, round_order = common.costmodel().probe, common.costmodel().round_order
    w = dict(kv.split("=") for kv in spec.split(","))
    phase, n, iters, rounds = w["phase"], int(w["n"]), int(w["iters"]), int(w["rounds"])
    world = Communicator()
    if phase == "C":
        result = overlap(world, n, iters, rounds)
        if world.rank == 0:
            common.emit(result)
        world.free()
        return
    if phase == "A":
        W = int(w["workers"])
        cases = [(v, p, s, p + s if v == "ps" else p) for p in range(2, W + 1)
                 for v, s in (("ps", 1), ("ps", 2), ("p2p", 0), ("ring", 0))]
    else:
        cases = [(v, world.size, 0, world.size) for v in ("ring", "hierarchical", "p2p", "native")]
    subs = {m: first_ranks(world, m) for m in sorted({c[3] for c in cases})}
    samples = {i: [] for i in range(len(cases))}
    nics = {i: [] for i in range(len(cases))}
    for r in range(rounds):                        # interleaved, shuffled the same everywhere
        for i in round_order(len(cases), r, seed=7):
            v, p, s, m = cases[i]
            t, nic = _measure(world, subs, v, m, s, n, iters)
            samples[i].append(t)
            nics[i].append(nic)
    # mpidist's alpha-beta fit on the widest ring of the phase (and its link levels)
    fit_comm = subs[max(subs)]
    model = None
    if fit_comm is not None:
        sizes = tuple(sorted({max(4096, n * 4 // 16), n * 4 // 4, n * 4}))
        model = probe(fit_comm, sizes=sizes, reps=3, seconds=float(w["probe_s"])).to_json()
    model = world.comm.bcast(model, root=0)
    for sub in subs.values():
        if sub is not None:
            sub.free()
    if world.rank == 0:
        rows = []
        for i, (v, p, s, m) in enumerate(cases):
            rows.append({"variant": v, "workers": p, "servers": s, "members": m,
                         "seconds": samples[i], "nic": nics[i]})
        common.emit({"cases": rows, "model": model, "nodes": world.num_nodes,
                     "per_node": world.local_size, "n": n, "iters": iters})
    world.free()
