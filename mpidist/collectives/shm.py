"""Shared-memory allreduce for the ranks of one node, in the node's window (collectives.node).

Without a single-copy transport every byte a ring step moves is copied twice, through the
MPI library's shared buffers. Here (node.reductions has the steps):
1. publish: copy my input into my slice of a window every rank of the node reads; barrier;
2. reduce: my chunk, chunk(n, rank, size), over every rank's input in rank order, block by
   block (the running result stays in cache), into my own slice and my output;
3. gather: barrier; copy every other rank's reduced chunk straight out of its slice.
About a third of the ring's memory traffic, and two barriers instead of 2(p-1) steps; every
rank ends with the same bits. reduce_scatter is steps 1-2, allgather step 3. Communicators
spanning several nodes, and device buffers, fall back to the ring; the window is the
communicator's own (node.window_of), grown collectively.

Cost: 2 alpha (barriers) + 2 n beta (copies in and out) + n gamma.
"""
from __future__ import annotations

import numpy as np

from mpidist.collectives import ring
from mpidist.collectives.node import reductions, usable, window_of
from mpidist.collectives.ops import Op

__all__ = ["allreduce", "reduce_scatter", "allgather", "preferred"]


def preferred(comm) -> bool:
    """Whether "auto" should take shm on comm: usable, and three or more ranks. Two ranks
    exchange each half once over the MPI library, which the copies into and out of the
    window cannot beat (docs/PERFORMANCE.md)."""
    return comm.size > 2 and usable(comm)


def allreduce(comm, sendbuf, recvbuf, op: Op):
    """Shared-memory allreduce (recvbuf may be sendbuf); the ring where it can not run."""
    if not usable(comm) or not isinstance(sendbuf, np.ndarray):
        return ring.allreduce(comm, sendbuf, recvbuf, op)
    reductions.allreduce(window_of(comm), sendbuf, recvbuf, op)
    return recvbuf


def reduce_scatter(comm, sendbuf, shard, op: Op, *, finalize_n: int | None = None):
    """Steps 1 and 2 of the allreduce: my chunk, reduced, into `shard`."""
    if not usable(comm) or not isinstance(sendbuf, np.ndarray):
        return ring.reduce_scatter(comm, sendbuf, shard, op, finalize_n=finalize_n)
    reductions.reduce_scatter(window_of(comm), sendbuf, shard, op, finalize_n=finalize_n)
    return shard


def allgather(comm, shard, out):
    """Publish my shard at its place in my slice; copy everyone's into out."""
    if not usable(comm) or not isinstance(out, np.ndarray):
        return ring.allgather(comm, shard, out)
    reductions.allgather(window_of(comm), shard, out)
    return out
