"""The peer-to-peer allreduce: every worker serves one shard, each pair talks directly."""
from __future__ import annotations

import numpy as np


def p2p_allreduce(comm, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Sum `x` over `comm` into `out`, without a ring or a tree.

    1. all-to-all: shard j of every gradient goes to worker j;
    2. worker j sums its p copies;
    3. all-to-all again: every worker sends its summed shard to every other.
    """
    from mpi4py import MPI
    from mpidist.partition import chunk
    p, me = comm.size, comm.rank
    parts = [chunk(x.size, r, p) for r in range(p)]
    counts = np.array([c for _, c in parts])
    displs = np.array([o for o, _ in parts])
    mine = counts[me]
    t = MPI.FLOAT if x.dtype == np.float32 else MPI.DOUBLE
    # 1. reduce-scatter by all-to-all
    recv = np.empty(p * mine, x.dtype)
    comm.comm.Alltoallv([x, counts, displs, t], [recv, [mine] * p, [mine * r for r in range(p)], t])
    # 2. my shard's sum
    shard = recv.reshape(p, mine).sum(axis=0, dtype=x.dtype)
    # 3. all-gather by all-to-all
    comm.comm.Alltoallv([shard, [mine] * p, [0] * p, t], [out, counts, displs, t])
    return out
