"""Binomial-tree allreduce: reduce to rank 0 along a binomial tree, then broadcast the one
reduced copy back down the same tree, both pipelined by segments.

Latency-friendly (2 log2 p steps of alpha) but every interior rank moves the whole buffer
per child, so it loses to the ring for large messages.

Cost: 2 ceil(log2 p) alpha + 2 ceil(log2 p) n beta + ceil(log2 p) n gamma (no pipelining
credit taken). The pipelined tree engine here also runs the double binary tree (dbtree.py);
ranges of one segment skip the pipeline: each tree moves its range as one message per edge
each way, with every child's receive posted first and the leaves sending at once.
"""
from __future__ import annotations

import functools
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


def _unsegmented(comm, sendbuf, recvbuf, op: Op, trees) -> None:
    """Reduce up and broadcast down each (non-empty) tree's range as one message."""
    mpi = comm.comm
    trees = [(2 * ti, t) for ti, t in enumerate(trees) if t.hi > t.lo]     # (tag offset, tree)
    # 1. reduce up: post every child's receive, let the leaves send, then reduce
    inbox = []
    for k, t in trees:
        bufs = [scratch(comm, 10 + k + ci, t.hi - t.lo, sendbuf.dtype, like=sendbuf)
                for ci in range(len(t.children))]
        inbox.append([(mpi.Irecv(b, c, _TAG + k), b) for b, c in zip(bufs, t.children)])
    ups = [mpi.Isend(sendbuf[t.lo:t.hi], t.parent, _TAG + k) for k, t in trees
           if not t.children and t.parent is not None]
    for (k, t), got in zip(trees, inbox):
        if not got and t.parent is not None:
            continue                                  # a leaf: sent above
        acc, src = recvbuf[t.lo:t.hi], sendbuf[t.lo:t.hi]
        for req, buf in got:
            req.Wait()
            reduce_into(op, src, buf, acc)
            src = acc
        if t.parent is not None:
            ups.append(mpi.Isend(acc, t.parent, _TAG + k))
        else:                                         # the root holds the one result
            if not same_view(src, acc):
                acc[...] = src
            op.finalize(acc, comm.size)
    # 2. broadcast down, roots first: my up-sends are done before the result overwrites them
    MPI.Request.Waitall(ups)
    downs = []
    for k, t in sorted(trees, key=lambda kt: kt[1].parent is not None):
        if t.parent is not None:
            mpi.Recv(recvbuf[t.lo:t.hi], t.parent, _TAG + k + 1)
        downs.extend(mpi.Isend(recvbuf[t.lo:t.hi], c, _TAG + k + 1) for c in t.children)
    MPI.Request.Waitall(downs)


def tree_allreduce(comm, sendbuf, recvbuf, op: Op, trees):
    """Reduce up, then broadcast down, each tree's element range, segment by segment.

    The trees' segments are interleaved, so with two complementary trees (dbtree) every
    rank sends and receives in both at once. Children's segments arrive in a window of
    scratch slots; a rank forwards a segment as soon as it has reduced (or received) it.
    """
    mpi, p = comm.comm, comm.size
    seg = max(1, segment_bytes() // max(1, sendbuf.itemsize))
    if all(t.hi - t.lo <= seg for t in trees):
        _unsegmented(comm, sendbuf, recvbuf, op, trees)
        return recvbuf
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


@functools.lru_cache(maxsize=256)
def _binomial(rank: int, size: int, n: int) -> tuple[Tree]:
    return (Tree(*binomial_tree(rank, size), 0, n),)


def allreduce(comm, sendbuf, recvbuf, op: Op):
    """Binomial-tree reduce to rank 0 + broadcast (recvbuf may be sendbuf)."""
    return tree_allreduce(comm, sendbuf, recvbuf, op, _binomial(comm.rank, comm.size,
                                                                len(sendbuf)))
