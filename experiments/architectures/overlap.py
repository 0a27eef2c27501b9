"""Phase C inside the MPI job: compute and communication overlapped or one after the other.

A step is a backward pass over `layers` equal layers, then the gradient allreduce. Compute
is a wait (the host is free meanwhile, as while an accelerator computes) as long as one
ring allreduce of the whole gradient. Sequential: all layers, then one ring allreduce (how
a PS or P2P step runs: pull, compute, push). Overlapped: each layer's gradient goes out by
allreduce_async as soon as it is done, and the step waits for all at the end (mpidist's
data-parallel buckets).
"""
from __future__ import annotations

import time

import numpy as np

from experiments import common


def overlap(world, n: int, iters: int, rounds: int, layers: int = 8) -> dict:
    """Every variant's step times (max over ranks), interleaved in a shuffled order."""
    from mpi4py import MPI
    from mpidist.collectives import allreduce, allreduce_async
    round_order = common.costmodel().round_order
    g = np.ones(n, np.float32)
    parts = np.array_split(g, layers)
    comm_t = []
    for _ in range(5):
        world.comm.Barrier()
        t0 = time.perf_counter()
        allreduce(g, algorithm="ring", comm=world)
        comm_t.append(time.perf_counter() - t0)
    compute = float(world.comm.bcast(np.median(comm_t[1:]), root=0))

    def sequential():
        for _ in range(layers):
            time.sleep(compute / layers)
        allreduce(g, algorithm="ring", comm=world)

    def overlapped():
        handles = []
        for part in reversed(parts):            # backward: the last layer's gradient first
            time.sleep(compute / layers)
            handles.append(allreduce_async(part, algorithm="ring", comm=world))
        for h in handles:
            h.wait()

    def comm_only():
        allreduce(g, algorithm="ring", comm=world)

    def compute_only():                          # a loaded host wakes late from each wait
        for _ in range(layers):
            time.sleep(compute / layers)

    calls = {"sequential": sequential, "overlapped": overlapped, "comm only": comm_only,
             "compute only": compute_only}
    times = {k: [] for k in calls}
    for r in range(rounds * iters):
        for j in round_order(len(calls), r, seed=11):
            name = list(calls)[j]
            world.comm.Barrier()
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(max(world.comm.allgather(time.perf_counter() - t0)))
    return {"compute_s": compute, "layers": layers, "times": times,
            "threaded": MPI.Query_thread() == MPI.THREAD_MULTIPLE}
