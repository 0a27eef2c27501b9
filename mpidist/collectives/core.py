"""The public collectives: argument checks, the mismatch guard, device staging and half
precision widening around the algorithms of the registry.

Semantics: `allreduce(buf)` reduces in place and returns buf (as a gradient allreduce
wants); with `out=` the result goes to out and buf is left unchanged. `reduce_scatter` and
`allgather` return new arrays unless `out=` is given.
"""
from __future__ import annotations

import numpy as np

from mpidist.collectives import flight, guard, native, ring, select, shm
from mpidist.collectives.arrays import accept_arrays
from mpidist.collectives.ops import (accumulator_dtype, check_dtype, dtype_name, get_op, narrow,
                                     widen)
from mpidist.collectives.registry import ALGORITHMS, get_algorithm
from mpidist.collectives.workspace import same_view, scratch
from mpidist.comm import as_communicator
from mpidist.kernels.backend import get_array_module, is_cupy
from mpidist.partition import chunk, counts_displs

__all__ = ["allreduce", "reduce_scatter", "allgather", "prepare_allreduce", "describe_allreduce", "run_allreduce",
           "reduced_bytes", "flat_view", "check_out", "read_only"]

_PARTS = {"ring": ring, "shm": shm, "native": native}
_WIDE, _WIDE_SHARD = "core.wide", "core.wide_shard"     # float32 copies of half precision
_STAGE_IN, _STAGE_OUT = "core.stage_in", "core.stage_out"  # CuPy data staged for a host-only MPI


def flat_view(x, what: str):
    """A 1-D view of a contiguous NumPy/CuPy array; TypeError/ValueError otherwise (other
    arrays reach here as such views: accept_arrays)."""
    if not (isinstance(x, np.ndarray) or is_cupy(x)):
        raise TypeError(f"{what} must be a NumPy or CuPy array (or a torch tensor, DLPack, "
                        f"buffer-protocol or __cuda_array_interface__ data), got "
                        f"{type(x).__name__}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous; pass np.ascontiguousarray({what})")
    check_dtype(x.dtype)
    return x if x.ndim == 1 else x.reshape(-1)


def check_out(out, like, n: int, what: str):
    out_flat = flat_view(out, "out")
    if out.dtype != like.dtype:
        raise TypeError(f"out has dtype {out.dtype} but {what} has {like.dtype}; they must match")
    if out_flat.size != n:
        raise ValueError(f"out has {out_flat.size} elements, {n} expected")
    if type(out) is not type(like):
        raise TypeError("out and the input must both be NumPy or both CuPy arrays")
    return out_flat


def read_only(a) -> bool:
    """A read-only NumPy array (CuPy arrays have no read-only mode, nor flags.writeable)."""
    return not is_cupy(a) and not a.flags.writeable


def _overlap(a, b) -> bool:
    if is_cupy(a):
        lo_a, lo_b = a.data.ptr, b.data.ptr
        return lo_a < lo_b + b.nbytes and lo_b < lo_a + a.nbytes
    return np.shares_memory(a, b)


def _on_host(c, x, slot: str, copy: bool = True):
    """The buffer MPI works on for x: x itself (host data, or device data for a CUDA-aware
    MPI once the stream is synchronised), else pinned host scratch memory, reused from call
    to call, holding a copy of x (uninitialised when not `copy`: an output)."""
    if not is_cupy(x) or c.cuda_aware:
        return c.to_mpi(x)
    host = scratch(c, slot, x.size, x.dtype, pinned=True)
    if copy:
        x.get(out=host)                  # after the current stream's work, then waits
    return host


def _to_acc(c, x):
    """(buffer for MPI, widened?) for x: the float32 copy of half data (in scratch memory,
    reused from call to call), or x's buffer for MPI."""
    acc = accumulator_dtype(x.dtype)
    if acc != x.dtype:
        wide = scratch(c, _WIDE, x.size, acc, like=x)
        widen(x, wide)
        return _on_host(c, wide, _STAGE_IN), True
    return _on_host(c, x, _STAGE_IN), False


def _store(src, dst, widened: bool) -> None:
    """Copy an MPI-side result src into the caller's dst (narrowing half precision, back
    to the device for staged CuPy data); nothing when src is dst."""
    if same_view(src, dst):
        return
    if is_cupy(dst) and not is_cupy(src):
        if widened:
            wide, src = src, np.empty(src.size, dst.dtype)
            narrow(wide, src)
        dst.set(src)
    elif widened:
        narrow(src, dst)
    else:
        dst[...] = src


def describe_allreduce(comm, buf, op, algorithm, out, kind: str = "allreduce"):
    """The local half of prepare_allreduce: (comm, x, y, op, algorithm name, signature,
    error), the argument error (or None) still to be voted on by guard.check, which every
    rank must call with it (x, y and op are None after an error)."""
    c = as_communicator(comm)
    error, signature, name, x, y, opx = None, None, algorithm, None, None, None
    try:
        x = flat_view(buf, "buf")
        opx = get_op(op)
        if algorithm == "auto":
            name = select.choose(c, reduced_bytes(x))
        else:
            get_algorithm(algorithm)
        y = x if out is None or out is buf else check_out(out, buf, x.size, "buf")
        if y is not x and _overlap(x, y):
            raise ValueError("out overlaps buf; pass out=None to reduce in place")
        if read_only(y):
            raise ValueError("the result array is read-only; pass a writeable out=")
        signature = (kind, ("n", x.size), ("dtype", dtype_name(x.dtype)), ("op", opx.name),
                     ("algorithm", algorithm if name == algorithm else _AUTO[name]))
    except (TypeError, ValueError) as exc:
        error = exc
    return c, x, y, opx, name, signature, error


def prepare_allreduce(comm, buf, op, algorithm, out, kind: str = "allreduce",
                      carry: bool = False):
    """Check the arguments on every rank together (mismatch guard included).

    Returns (comm, x, y, op, algorithm name, entry): x the flat input, y the flat output (x
    itself in place); "auto" is resolved here by select.choose (a table lookup, the same on
    every rank holding the same table: the guard compares the resolved name too); entry is
    the call's flight record, which the caller ends (flight.end) once the reduction is
    complete. carry: a native allreduce may be done by the check itself (guard.check_reduce);
    the name is then None.
    """
    c, x, y, opx, name, signature, error = describe_allreduce(comm, buf, op, algorithm, out, kind)
    if carry and error is None and name == "native":
        entry, k = guard.check_reduce(c, signature, error, x, y, opx)
        return c, x, y, opx, None if k else name, entry
    entry = guard.check(c, signature, error)
    return c, x, y, opx, name, entry


_AUTO = {name: f"auto: {name}" for name in ALGORITHMS}      # auto's resolved names, as signed


def reduced_bytes(x) -> int:
    """The bytes an allreduce of x reduces, which auto's choice is keyed by: half precision
    is widened to float32 (the only 2-byte dtypes)."""
    return x.nbytes if x.itemsize > 2 else 2 * x.nbytes


def run_allreduce(c, x, y, opx, name: str) -> None:
    """Run algorithm `name` on checked arguments: widen half precision, stage device data."""
    if x.size == 0:
        return
    fn = ALGORITHMS[name]
    if type(x) is np.ndarray and accumulator_dtype(x.dtype) is x.dtype:    # the fast path
        fn(c, x, y, opx)
        return
    sbuf, widened = _to_acc(c, x)
    if y is x:
        fn(c, sbuf, sbuf, opx)
        _store(sbuf, x, widened)
    else:
        rbuf = sbuf if widened else _on_host(c, y, _STAGE_OUT, copy=False)
        fn(c, sbuf, rbuf, opx)
        _store(rbuf, y, widened)


@accept_arrays("buf", "out", in_place=True)
def allreduce(buf, *, op="sum", algorithm="auto", comm=None, out=None):
    """Reduce `buf` over all ranks of `comm`; every rank gets the same bits.

    op: "sum", "avg", "min", "max", "prod". algorithm: a name in ALGORITHMS or "auto"
    (select.choose: the decision table's entry, or the built-in rule). out=None reduces in
    place and returns buf; otherwise the result goes to out (same dtype and size) and out
    is returned.
    """
    c, x, y, opx, name, entry = prepare_allreduce(comm, buf, op, algorithm, out, carry=True)
    try:
        if name is not None:
            run_allreduce(c, x, y, opx, name)
    finally:
        flight.end(entry)
    return buf if out is None else out


def _part_module(algorithm: str, c):
    """The module for reduce_scatter/allgather; "auto": shm within one node of three or more
    ranks, else ring."""
    if algorithm == "auto":
        return shm if shm.preferred(c) else ring
    try:
        return _PARTS[algorithm]
    except KeyError:
        raise ValueError(f"unknown algorithm {algorithm!r} for reduce_scatter/allgather; "
                         f"valid: auto, {', '.join(_PARTS)}") from None


@accept_arrays("buf", "out")
def reduce_scatter(buf, *, op="sum", comm=None, out=None, algorithm="auto"):
    """Reduce `buf` over all ranks and return my shard: elements chunk(len(buf), rank, size).

    out: optional array of exactly that shard's length (may be that chunk of buf itself).
    algorithm: "ring" (pipelined, bandwidth-optimal), "shm" (shared-memory window, one
    node), "native" (MPI_Reduce_scatter), or "auto" (shm within one node of three or more
    ranks, else ring).
    """
    c = as_communicator(comm)
    error, signature = None, None
    try:
        x = flat_view(buf, "buf")
        opx = get_op(op)
        part = _part_module(algorithm, c)
        offset, count = chunk(x.size, c.rank, c.size)
        y = get_array_module(x).empty(count, dtype=x.dtype) if out is None else \
            check_out(out, buf, count, "buf")
        if read_only(y):
            raise ValueError("out is read-only; pass a writeable out=")
        in_place = count > 0 and _overlap(x, y)
        if in_place and not same_view(x[offset:offset + count], y):
            raise ValueError(f"out overlaps buf other than as this rank's chunk "
                             f"buf[{offset}:{offset + count}]")
        signature = ("reduce_scatter", ("n", x.size), ("dtype", dtype_name(x.dtype)),
                     ("op", opx.name), ("algorithm", algorithm))
    except (TypeError, ValueError) as exc:
        error = exc
    entry = guard.check(c, signature, error)
    try:
        if x.size:
            sbuf, widened = _to_acc(c, x)
            if widened:
                rbuf = scratch(c, _WIDE_SHARD, count, sbuf.dtype, like=sbuf)
            elif in_place and part is native:          # MPI's reduce-scatter can not alias
                rbuf = get_array_module(sbuf).empty(count, dtype=sbuf.dtype)
            else:
                rbuf = _on_host(c, y, _STAGE_OUT, copy=False)
            part.reduce_scatter(c, sbuf, rbuf, opx, finalize_n=c.size)
            _store(rbuf, y, widened)
    finally:
        flight.end(entry)
    return y if out is None else out


@accept_arrays("shard", "out")
def allgather(shard, *, comm=None, out=None, algorithm="auto"):
    """Gather every rank's shard into the full array; shard r holds chunk(n, r, size).

    Without out, n is the sum of the shard lengths (checked against the chunk() partition).
    algorithm: "ring", "shm", "native" (MPI_Allgatherv) or "auto" (as in reduce_scatter).
    """
    c = as_communicator(comm)
    error, signature = None, None
    try:
        s = flat_view(shard, "shard")
        part = _part_module(algorithm, c)
        if out is None:
            n = yo = None
        else:
            yo = flat_view(out, "out")
            if out.dtype != shard.dtype or type(out) is not type(shard):
                raise TypeError(f"out ({type(out).__name__} {out.dtype}) must match the shard "
                                f"({type(shard).__name__} {shard.dtype})")
            n = yo.size
            if read_only(yo):
                raise ValueError("out is read-only; pass a writeable out=")
            if s.size != chunk(n, c.rank, c.size)[1]:
                raise ValueError(f"shard has {s.size} elements but chunk({n}, {c.rank}, "
                                 f"{c.size}) has {chunk(n, c.rank, c.size)[1]}")
        signature = ("allgather", ("n", n), ("dtype", dtype_name(s.dtype)),
                     ("algorithm", algorithm))
    except (TypeError, ValueError) as exc:
        error = exc
    entry = guard.check(c, signature, error)
    try:
        return _allgather(c, s, out, yo, part, n)
    finally:
        flight.end(entry)


def _allgather(c, s, out, yo, part, n):
    """allgather after the guard: yo is out's flat view, or None to allocate the result."""
    if out is None:
        counts = c.comm.allgather(s.size)
        n = sum(counts)
        if counts != counts_displs(n, c.size)[0]:
            raise ValueError(f"shard lengths {counts} do not follow the chunk() partition of "
                             f"{n} elements, {counts_displs(n, c.size)[0]}; pass out= or fix "
                             f"the shards")
        yo = get_array_module(s).empty(n, dtype=s.dtype)
        out = yo
    if n == 0:
        return out
    raw = np.dtype(f"u{s.dtype.itemsize}")            # no arithmetic: move the bits
    sb = _on_host(c, s, _STAGE_IN).view(raw)
    ob = _on_host(c, yo, _STAGE_OUT, copy=False)
    part.allgather(c, sb, ob.view(raw))
    c.from_mpi(ob, yo)
    return out
