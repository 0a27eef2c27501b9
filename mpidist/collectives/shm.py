"""Shared-memory allreduce for the ranks of one node, over an MPI shared-memory window.

Without a single-copy transport every byte a ring step moves is copied twice, through the
MPI library's shared buffers. Here:
1. publish: copy my input into my slice of a window every rank of the node reads; barrier;
2. reduce: chunk(n, rank, size) of every rank's slice, in rank order, block by block (the
   running sum stays in cache), into my own slice: the one reduced copy of that chunk;
3. gather: barrier; copy every rank's reduced chunk straight out of its slice.
About a third of the ring's memory traffic, and three barriers instead of 2(p-1) steps;
every rank ends with the same bits. reduce_scatter is steps 1-2, allgather step 3.
Communicators spanning several nodes, and device buffers, fall back to the ring; the window
is allocated on first use per communicator and grown collectively.

Cost: 3 alpha (barriers) + 2 n beta (copies in and out) + n gamma.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np
from mpi4py import MPI

from mpidist import ulfm
from mpidist.collectives import ring
from mpidist.collectives.ops import Op
from mpidist.collectives.workspace import scratch
from mpidist.comm import on_free
from mpidist.partition import counts_displs

__all__ = ["allreduce", "reduce_scatter", "allgather", "usable", "preferred"]

_BLOCK_BYTES = 256 << 10
_windows: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def usable(comm) -> bool:
    """One node (not simulated as several), more than one rank, and no fault tolerance
    (ULFM does not cover shared-memory windows: a dead rank would hang the others)."""
    return comm.size > 1 and comm.num_nodes == 1 and not ulfm.active()


def preferred(comm) -> bool:
    """Whether "auto" should take shm on comm: usable, and three or more ranks. Two ranks
    exchange each half once over the MPI library, which the copies into and out of the
    window cannot beat (docs/PERFORMANCE.md)."""
    return comm.size > 2 and usable(comm)


class _Window:
    """A shared window with one slice per rank, and NumPy views of every slice."""

    def __init__(self, comm, nbytes: int):
        self.nbytes = nbytes
        self.win = MPI.Win.Allocate_shared(nbytes, 1, comm=comm.comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.slices = [np.frombuffer(self.win.Shared_query(r)[0], np.uint8)[:nbytes]
                       for r in range(comm.size)]

    def free(self) -> None:
        self.slices = []
        self.win.Unlock_all()
        self.win.Free()


def _window(comm, nbytes: int) -> _Window:
    w = _windows.get(comm)
    if w is None or w.nbytes < nbytes:
        if w is not None:
            w.free()
        w = _Window(comm, max(nbytes, w.nbytes * 2 if w is not None else 1 << 16))
        with _lock:
            _windows[comm] = w
    return w


def _release(comm) -> None:
    """Free comm's window (collective, from Communicator.free on every rank)."""
    with _lock:
        w = _windows.pop(comm, None)
    if w is not None:
        w.free()


on_free(_release)


def _barrier(comm, w: _Window) -> None:
    """Make my stores visible, wait for everyone, then see theirs."""
    w.win.Sync()
    comm.comm.Barrier()
    w.win.Sync()


def _reduce_chunk(comm, part, lo_r: int, hi_r: int, op: Op, dst, *,
                  finalize_n: int | None = None, copy_to=None) -> None:
    """dst = elements [lo_r, hi_r) reduced over every rank's slice, in rank order, one
    cache-sized block at a time (dst may be my own slice's range); each block finalized
    over finalize_n contributors and also stored into copy_to while it is in cache."""
    p, dt = comm.size, dst.dtype
    block = max(1, _BLOCK_BYTES // dt.itemsize)
    tmp = scratch(comm, "shm.block", min(block, hi_r - lo_r), dt)
    for lo in range(lo_r, hi_r, block):
        hi = min(lo + block, hi_r)
        acc, out = tmp[:hi - lo], dst[lo - lo_r:hi - lo_r]
        op.ufunc(part[0][lo:hi], part[1][lo:hi], out=acc if p > 2 else out)
        for k in range(2, p):
            op.ufunc(acc, part[k][lo:hi], out=acc if k < p - 1 else out)
        if finalize_n is not None:
            op.finalize(out, finalize_n)
        if copy_to is not None:
            copy_to[lo - lo_r:hi - lo_r] = out


def _slices(comm, n: int, dt):
    w = _window(comm, n * dt.itemsize)
    return w, [s[:n * dt.itemsize].view(dt) for s in w.slices]


def _publish_and_reduce(comm, w, part, sendbuf, lo, hi, op: Op, out, *,
                        finalize_n: int | None = None, copy_to=None) -> None:
    """Publish my input in my slice (once everyone has finished reading the previous call's
    results), then reduce elements [lo, hi) over every rank's copy into out (_reduce_chunk)."""
    _barrier(comm, w)
    part[comm.rank][...] = sendbuf
    _barrier(comm, w)
    _reduce_chunk(comm, part, lo, hi, op, out, finalize_n=finalize_n, copy_to=copy_to)


def allreduce(comm, sendbuf, recvbuf, op: Op):
    """Shared-memory allreduce (recvbuf may be sendbuf); the ring where it can not run."""
    if not usable(comm) or not isinstance(sendbuf, np.ndarray):
        return ring.allreduce(comm, sendbuf, recvbuf, op)
    p, r = comm.size, comm.rank
    counts, displs = counts_displs(len(sendbuf), p)
    w, part = _slices(comm, len(sendbuf), sendbuf.dtype)
    # 1.-2. publish my input, reduce my chunk over every rank's copy into my own slice,
    #       and into my place in recvbuf while each block is in cache (my input is
    #       published by then, so recvbuf may be sendbuf)
    lo, hi = displs[r], displs[r] + counts[r]
    _publish_and_reduce(comm, w, part, sendbuf, lo, hi, op, part[r][lo:hi],
                        finalize_n=p, copy_to=recvbuf[lo:hi])
    # 3. gather the other ranks' reduced chunks
    _barrier(comm, w)
    for j in range(p):
        if j != r:
            recvbuf[displs[j]:displs[j] + counts[j]] = part[j][displs[j]:displs[j] + counts[j]]
    return recvbuf


def reduce_scatter(comm, sendbuf, shard, op: Op, *, finalize_n: int | None = None):
    """Steps 1 and 2 of the allreduce: my chunk, reduced, into `shard`."""
    if not usable(comm) or not isinstance(sendbuf, np.ndarray):
        return ring.reduce_scatter(comm, sendbuf, shard, op, finalize_n=finalize_n)
    p, r = comm.size, comm.rank
    counts, displs = counts_displs(len(sendbuf), p)
    w, part = _slices(comm, len(sendbuf), sendbuf.dtype)
    _publish_and_reduce(comm, w, part, sendbuf, displs[r], displs[r] + counts[r], op, shard,
                        finalize_n=finalize_n)
    return shard


def allgather(comm, shard, out):
    """Publish my shard at its place in my slice; copy everyone's into out."""
    if not usable(comm) or not isinstance(out, np.ndarray):
        return ring.allgather(comm, shard, out)
    p, r = comm.size, comm.rank
    counts, displs = counts_displs(len(out), p)
    w, part = _slices(comm, len(out), out.dtype)
    _barrier(comm, w)
    part[r][displs[r]:displs[r] + counts[r]] = shard
    _barrier(comm, w)
    for j in range(p):
        out[displs[j]:displs[j] + counts[j]] = part[j][displs[j]:displs[j] + counts[j]]
    return out
