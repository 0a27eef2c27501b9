"""Binomial-tree allreduce: reduce along a binomial tree, then broadcast the reduced copy
back down the same tree, both pipelined by segments.

Latency-friendly but every interior rank moves the whole buffer per child, so it loses to
the ring for large messages. The pipelined tree engine here also runs the double binary
tree (dbtree.py). Ranges of one segment move as one message per edge each way; in the
binomial tree the top edge of such a range (rank 0 and the root of the other half) is an
exchange: the two half-roots swap partial results and both combine them rank 0's half
first, so both hold the same bits one message step earlier. The double binary tree keeps
its top edges: each of its roots reduces only its half, which an exchange would double.

Cost: (2 ceil(log2 p) - 1) alpha + 2 ceil(log2 p) n beta + ceil(log2 p) n gamma (no
pipelining credit taken).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from mpi4py import MPI

from mpidist.collectives.ops import Op, reduce_into
from mpidist.collectives.ring import segments
from mpidist.collectives.workspace import same_view, scratch
from mpidist.mpienv import segment_bytes

__all__ = ["allreduce", "Tree", "binomial_tree", "tree_allreduce"]

_TAG = 401
_TOP_TAG = 421       # the two roots' exchange
_WINDOW = 4          # segments per child received ahead of the reduction


@dataclass(frozen=True)
class Tree:
    """One rank's view of a reduction tree over elements [lo, hi) of the buffer.

    peer: on the two roots of a tree whose top edge is an exchange (_binomial), the other
    root; lead: whether my partial result goes first when the two are combined."""
    parent: int | None
    children: tuple[int, ...]
    lo: int
    hi: int
    peer: int | None = None
    lead: bool = False


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


def top_child(size: int) -> int:
    """The root's last child in the binomial tree: the largest power of two below size
    (size > 1), root of the ranks from there on."""
    return 1 << ((size - 1).bit_length() - 1)


def _settle_root(comm, t: Tree, mine, out, op: Op, name: str, tag: int) -> None:
    """On a root: out = the tree's result, finalized. With a peer, swap partials with it
    and combine them lead-first, so both roots hold the same bits."""
    if t.peer is None:
        if not same_view(mine, out):
            out[...] = mine
    else:
        theirs = scratch(comm, name, len(mine), mine.dtype, like=mine)
        comm.comm.Sendrecv(mine, t.peer, tag, theirs, t.peer, tag)
        reduce_into(op, *((mine, theirs) if t.lead else (theirs, mine)), out)
    op.finalize(out, comm.size)


def _reduce_then_broadcast(t: Tree) -> Tree:
    """The tree with its top exchange undone: the pipeline hides the extra step of the top
    edge, and its windowed nonblocking transfers tolerate ranks that share a core, which a
    blocking exchange per segment does not (docs/PERFORMANCE.md, tree)."""
    if t.peer is None:
        return t
    if t.lead:
        return Tree(None, t.children + (t.peer,), t.lo, t.hi)
    return Tree(t.peer, t.children, t.lo, t.hi)


def _up(tree: int, child: int) -> str:
    """The scratch buffer where child `child` of tree `tree` sends its partial results."""
    return f"tree.up.{tree}.{child}"


def _unsegmented(comm, sendbuf, recvbuf, op: Op, trees) -> None:
    """Reduce up and broadcast down each (non-empty) tree's range as one message."""
    mpi = comm.comm
    # 1. reduce up: post every child's receive, let the leaves send, then reduce
    work, ups = [], []                      # (tag offset, tree, [(request, buffer)])
    for ti, t in enumerate(trees):
        if t.hi > t.lo and (t.children or t.parent is None):
            k = 2 * ti
            got = [(mpi.Irecv(b, c, _TAG + k), b) for b, c in zip(
                [scratch(comm, _up(ti, ci), t.hi - t.lo, sendbuf.dtype, like=sendbuf)
                 for ci in range(len(t.children))], t.children)]
            work.append((k, t, got))
    for ti, t in enumerate(trees):
        if t.hi > t.lo and not t.children and t.parent is not None:
            ups.append(mpi.Isend(sendbuf[t.lo:t.hi], t.parent, _TAG + 2 * ti))
    for k, t, got in work:
        acc, src = recvbuf[t.lo:t.hi], sendbuf[t.lo:t.hi]
        for req, buf in got:
            req.Wait()
            reduce_into(op, src, buf, acc)
            src = acc
        if t.parent is not None:
            ups.append(mpi.Isend(acc, t.parent, _TAG + k))
        else:                                         # a root: the tree's result
            _settle_root(comm, t, src, acc, op, f"tree.peer.{k // 2}", _TOP_TAG + k)
    # 2. broadcast down, roots first: my up-sends are done before the result overwrites them
    if ups:
        MPI.Request.Waitall(ups)
    downs = []
    for k, t, _ in work:
        if t.parent is None:
            downs.extend(mpi.Isend(recvbuf[t.lo:t.hi], c, _TAG + k + 1) for c in t.children)
    for ti, t in enumerate(trees):
        if t.hi > t.lo and t.parent is not None:
            k = 2 * ti
            mpi.Recv(recvbuf[t.lo:t.hi], t.parent, _TAG + k + 1)
            downs.extend(mpi.Isend(recvbuf[t.lo:t.hi], c, _TAG + k + 1) for c in t.children)
    if downs:
        MPI.Request.Waitall(downs)


def tree_allreduce(comm, sendbuf, recvbuf, op: Op, trees):
    """Reduce up, then broadcast down, each tree's element range, segment by segment.

    The trees' segments are interleaved, so with two complementary trees (dbtree) every
    rank sends and receives in both at once. Children's segments arrive in a window of
    scratch slots; a rank forwards a segment as soon as it has reduced (or received) it.
    """
    mpi, p = comm.comm, comm.size
    seg = max(1, segment_bytes() // max(1, sendbuf.itemsize))
    if len(sendbuf) <= seg or all(t.hi - t.lo <= seg for t in trees):
        _unsegmented(comm, sendbuf, recvbuf, op, trees)
        return recvbuf
    trees = [_reduce_then_broadcast(t) for t in trees]
    plans = [segments(t.lo, t.hi, seg) for t in trees]
    nseg = max((len(s) for s in plans), default=0)
    slots = {}
    for ti, t in enumerate(trees):
        need = t.hi - t.lo if len(plans[ti]) <= _WINDOW else _WINDOW * seg
        for ci in range(len(t.children)):
            slots[ti, ci] = scratch(comm, _up(ti, ci), need, sendbuf.dtype, like=sendbuf)

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
    """This rank's binomial tree, its top edge (0 - top_child) an exchange of two roots."""
    parent, children = binomial_tree(rank, size)
    half = top_child(size) if size > 1 else None
    if rank == 0 and half is not None:
        return (Tree(None, children[:-1], 0, n, half, True),)
    if rank == half:
        return (Tree(None, children, 0, n, 0, False),)
    return (Tree(parent, children, 0, n),)


def allreduce(comm, sendbuf, recvbuf, op: Op):
    """Binomial-tree reduce to two half-roots, their exchange, and broadcast (recvbuf may
    be sendbuf)."""
    return tree_allreduce(comm, sendbuf, recvbuf, op, _binomial(comm.rank, comm.size,
                                                                len(sendbuf)))
