"""Binomial-tree allreduce: reduce to rank 0 along a binomial tree, then broadcast the one
reduced copy back down the same tree, both pipelined by segments.

Latency-friendly (2 log2 p steps of alpha) but every interior rank moves the whole buffer
per child, so it loses to the ring for large messages.

Cost: 2 ceil(log2 p) alpha + 2 ceil(log2 p) n beta + ceil(log2 p) n gamma (no pipelining
credit taken). The pipelined tree engine here also runs the double binary tree (dbtree.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI

from mpidist.collectives.ops import Op, reduce_into
from mpidist.collectives.ring import segment_bytes
from mpidist.collectives.scratch import same_view, scratch

__all__ = ["allreduce", "Tree", "binomial_tree", "tree_allreduce"]

_TAG = 401
_WINDOW = 4          # segments per child received ahead of the reduction


@dataclass(frozen=True)
class Tree:
    """One rank's view of a reduction tree over elements [lo, hi) of the buffer."""
    parent: int | None
    children: tuple[int, ...]
    lo: int
    hi: int


def binomial_tree(rank: int, size: int) -> tuple[int | None, tuple[int, ...]]:
    """(parent, children) in the binomial tree rooted at 0; children nearest first."""
    parent, mask = None, 1
    while mask < size:
        if rank & mask:
            parent = rank - mask
            break
        mask <<= 1
    children = tuple(rank + m for m in (1 << k for k in range(mask.bit_length() - 1))
                     if rank + m < size)
    return parent, children


def _segments(lo: int, hi: int, seg: int):
    return [(a, min(a + seg, hi)) for a in range(lo, hi, seg)]


def tree_allreduce(comm, sendbuf, recvbuf, op: Op, trees: list[Tree]):
    """Reduce up, then broadcast down, each tree's element range, segment by segment.

    The trees' segments are interleaved, so with two complementary trees (dbtree) every
    rank sends and receives in both at once. Children's segments arrive in a window of
    scratch slots; a rank forwards a segment as soon as it has reduced (or received) it.
    """
    mpi, p = comm.comm, comm.size
    seg = max(1, segment_bytes() // max(1, sendbuf.itemsize))
    plans = [_segments(t.lo, t.hi, seg) for t in trees]
    nseg = max((len(s) for s in plans), default=0)
    slots = {}
    for ti, t in enumerate(trees):
        need = t.hi - t.lo if len(plans[ti]) <= _WINDOW else _WINDOW * seg
        for ci in range(len(t.children)):
            slots[ti, ci] = scratch(comm, 10 + 2 * ti + ci, need, sendbuf.dtype, like=sendbuf)

    def post_child(ti, ci, k):
        a, b = plans[ti][k]
        buf = slots[ti, ci][(k % _WINDOW) * seg:(k % _WINDOW) * seg + (b - a)]
        return mpi.Irecv(buf, trees[ti].children[ci], _TAG + 2 * ti), buf

    pending = {(ti, ci, k): post_child(ti, ci, k) for ti, t in enumerate(trees)
               for ci in range(len(t.children)) for k in range(min(_WINDOW, len(plans[ti])))}
    ups = []
    # 1. reduce up each tree, segment by segment
    for k in range(nseg):
        for ti, t in enumerate(trees):
            if k >= len(plans[ti]):
                continue
            a, b = plans[ti][k]
            acc, src = recvbuf[a:b], sendbuf[a:b]
            for ci in range(len(t.children)):
                req, buf = pending.pop((ti, ci, k))
                req.Wait()
                reduce_into(op, src, buf, acc)
                src = acc
                if k + _WINDOW < len(plans[ti]):
                    pending[ti, ci, k + _WINDOW] = post_child(ti, ci, k + _WINDOW)
            if t.parent is not None:
                ups.append(mpi.Isend(src, t.parent, _TAG + 2 * ti))
            else:                                     # the root holds the one result
                if not same_view(src, acc):
                    acc[...] = src
                op.finalize(acc, p)
    # 2. broadcast down: my up-sends are done before the result overwrites their buffers
    MPI.Request.Waitall(ups)
    downs_in = {(ti, k): mpi.Irecv(recvbuf[a:b], t.parent, _TAG + 2 * ti + 1)
                for ti, t in enumerate(trees) if t.parent is not None
                for k, (a, b) in enumerate(plans[ti])}
    downs = []
    for k in range(nseg):
        for ti, t in enumerate(trees):
            if k >= len(plans[ti]):
                continue
            a, b = plans[ti][k]
            if t.parent is not None:
                downs_in.pop((ti, k)).Wait()
            downs.extend(mpi.Isend(recvbuf[a:b], c, _TAG + 2 * ti + 1) for c in t.children)
    MPI.Request.Waitall(downs)
    return recvbuf


def allreduce(comm, sendbuf, recvbuf, op: Op):
    """Binomial-tree reduce to rank 0 + broadcast (recvbuf may be sendbuf)."""
    parent, children = binomial_tree(comm.rank, comm.size)
    return tree_allreduce(comm, sendbuf, recvbuf, op, [Tree(parent, children, 0, len(sendbuf))])
