"""Preallocated work buffers, reused across calls so a collective allocates nothing
in steady state. One set per communicator (the async worker has its own communicator,
so it never shares a buffer with the caller's thread), each buffer named by its owner
("ring.work.0", "tree.up.0.1", ...): two algorithms that run inside one call (the
half-precision widening around the ring) never share one.

    buf = scratch(comm, "ring.work.0", count, dtype, like=sendbuf)
"""
from __future__ import annotations

import threading
import weakref

import numpy as np
from mpi4py import MPI

from mpidist.comm import on_free
from mpidist.kernels.backend import get_array_module

__all__ = ["scratch", "release", "same_view"]

_buffers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def scratch(comm, name: str, count: int, dtype, like=None, pinned: bool = False):
    """A 1-D array of `count` elements for (comm, name), on the device of `like`, or a
    NumPy array in page-locked host memory when `pinned` (CuPy's staging buffers: copies
    to and from the GPU run at full PCIe/NVLink speed, with no page faults).

    name: "module.purpose[.index]" of the owner. The contents are undefined; the memory
    stays cached (grown when a call needs more) until `release(comm)`. A typed view of it
    is cached per dtype, so a steady call costs two dictionary lookups and one slice.
    """
    if not isinstance(name, str):
        raise TypeError(f"a scratch buffer is named by its owner (\"ring.work.0\"), got {name!r}")
    if pinned:
        import cupyx                     # optional: only CuPy data is staged in pinned memory
        where, empty = "pinned", cupyx.empty_pinned
    elif like is None or type(like) is np.ndarray:
        where, empty = "host", np.empty
    else:
        where, empty = "device", get_array_module(like).empty
    per_comm = _buffers.get(comm)
    if per_comm is None:
        with _lock:                      # the async worker thread allocates for its own comm
            per_comm = _buffers.setdefault(comm, {})
    key = (name, where)
    entry = per_comm.get(key)            # (raw bytes, {dtype: typed view of all of them})
    typed = None if entry is None else entry[1].get(dtype)
    if typed is not None and typed.size >= count:
        return typed[:count]
    dt = np.dtype(dtype)
    if entry is None or entry[0].nbytes < count * dt.itemsize:
        entry = (empty(max(count * dt.itemsize, 64), dtype=np.uint8), {})
        per_comm[key] = entry
    raw = entry[0]
    typed = raw[:raw.nbytes // dt.itemsize * dt.itemsize].view(dt)
    entry[1][dtype] = typed
    return typed[:count]


def release(comm=None) -> None:
    """Drop the cached scratch memory of one communicator (or of all)."""
    with _lock:
        if comm is None:
            _buffers.clear()
        else:
            _buffers.pop(comm, None)


on_free(release)


def same_view(a, b) -> bool:
    """True when a and b are the same 1-D view of the same memory (no copy needed)."""
    if a is b:
        return True
    if a.size != b.size or a.dtype != b.dtype or type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):        # MPI.buffer: 8x faster than __array_interface__
        return MPI.buffer(a).address == MPI.buffer(b).address
    return a.data.ptr == b.data.ptr
