"""Tensor fusion and nonblocking allreduce.

Many small tensors (a model's gradients) are packed into buckets of at most
`bucket_bytes`, each reduced as one message, so the per-message latency is paid once per
bucket. `allreduce_async` returns a Handle at once; the reduction runs on a per-communicator
worker thread (over its own split of the communicator), in submission order, the same on
every rank, so a training loop can launch a bucket as soon as backward has produced it.
Needs MPI_THREAD_MULTIPLE; with a lower thread level the reduction runs inside the call.
For CuPy data the worker takes the caller's GPU and waits on the device for the caller's
stream. Arrays handed to allreduce_async must not be touched until wait() returns.
"""
from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

from mpi4py import MPI

from mpidist.collectives import flight, guard, select
from mpidist.collectives.arrays import accept_arrays
from mpidist.collectives.core import (check_out, describe_allreduce, flat_view, read_only,
                                     reduced_bytes, run_allreduce)
from mpidist.collectives.ops import get_op
from mpidist.collectives.handle import Handle
from mpidist.collectives.waits import mark_patient
from mpidist.collectives.registry import get_algorithm
from mpidist.comm import as_communicator, on_free
from mpidist.kernels.backend import get_array_module, handoff, take_over

__all__ = ["Handle", "allreduce_async", "buckets", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = int(os.environ.get("MPIDIST_BUCKET_BYTES", 25 << 20))
_ASYNC_COLOR = 0x6D7064        # the worker's communicator: one split of the caller's, cached
_VOTES_COLOR = 0x6D7065        # and the one its jobs' checks are voted on


class _Worker:
    def __init__(self, comm):
        self.comm = comm.split(_ASYNC_COLOR, comm.rank)
        # the guard's votes on the jobs, posted by the caller's thread (guard.post)
        self.votes = comm.split(_VOTES_COLOR, comm.rank)
        # its waits nap: it runs beside the caller's compute (waits.mark_patient)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpidist-allreduce",
                                       initializer=mark_patient)

    def submit(self, fn, *args, arrays=()) -> Future:
        """Run fn(worker's comm, *args) in order; `arrays`: the CuPy data it works on, whose
        device and pending stream work the worker thread takes over (handoff)."""
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            fut: Future = Future()
            try:
                fut.set_result(fn(self.comm, *args))
            except BaseException as exc:   # delivered by wait(), like a worker failure
                fut.set_exception(exc)
            return fut
        return self.pool.submit(_in_worker, handoff(arrays), fn, self.comm, *args)


def _in_worker(ready, fn, *args):
    take_over(ready)
    return fn(*args)


_workers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _worker(c) -> _Worker:
    """The worker of communicator c (collective on first use: it splits c)."""
    with _lock:
        w = _workers.get(c)
    if w is None:
        w = _Worker(c)
        with _lock:
            _workers[c] = w
    return w


def _stop_worker(c) -> None:
    """Finish c's queued jobs and end its worker thread (from Communicator.free)."""
    with _lock:
        w = _workers.pop(c, None)
    if w is not None:
        w.pool.shutdown(wait=True)


on_free(_stop_worker)


def buckets(arrays, bucket_bytes: int) -> list[list[int]]:
    """Indices of consecutive arrays packed greedily into buckets of at most bucket_bytes;
    a bucket holds one dtype; an array larger than bucket_bytes is a bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out: list[list[int]] = []
    size, key = 0, None
    for i, a in enumerate(arrays):
        k = (a.dtype, get_array_module(a).__name__)
        if out and k == key and size + a.nbytes <= bucket_bytes:
            out[-1].append(i)
            size += a.nbytes
        else:
            out.append([i])
            size, key = a.nbytes, k
    return out


def _fused(comm, packed, opx, name, dests, bounds):
    """Worker job: reduce one packed bucket, then scatter it back into its tensors."""
    run_allreduce(comm, packed, packed, opx, name)
    for d, (lo, hi) in zip(dests, bounds):
        d[...] = packed[lo:hi].reshape(d.shape)


@accept_arrays("buf", "out", in_place=True)
def allreduce_async(buf, *, op="sum", algorithm="auto", comm=None, out=None,
                    bucket_bytes: int | None = None) -> Handle:
    """Start an allreduce and return its Handle (h.wait() -> the result).

    buf: one array (in place, or into out=) or a list/tuple of arrays, fused into buckets
    of bucket_bytes (default DEFAULT_BUCKET_BYTES, env MPIDIST_BUCKET_BYTES); then out is
    None (in place) or a list of arrays like buf, and wait() returns that list.
    """
    c = as_communicator(comm)
    if not isinstance(buf, (list, tuple)):
        # the check's vote goes out now and the worker finishes it when the job's turn
        # comes: it travels while the jobs before it move data, and does not hold up the
        # caller's compute (a blocking check here would wait behind them, across nodes for
        # whole buckets); an argument error is raised by wait()
        c, x, y, opx, name, signature, error = describe_allreduce(c, buf, op, algorithm, out,
                                                                  "allreduce_async")
        w = _worker(c)
        posted = guard.post(w.votes, signature, error, record=c)
        fut = w.submit(_checked_allreduce, posted, x, y, opx, name,
                       arrays=() if error else (x, y))
        return Handle(buf if out is None else out, futures=[fut])
    return _allreduce_fused(c, list(buf), op, algorithm, out, bucket_bytes)


def _checked_allreduce(wc, posted, x, y, opx, name) -> None:
    """On the worker: the guard's check posted by the caller completed (a failed one
    explained on the worker's communicator wc), then the reduction."""
    entry = posted.finish(explain_on=wc.comm)
    try:
        run_allreduce(wc, x, y, opx, name)
    finally:
        flight.end(entry)


def _allreduce_fused(c, arrays, op, algorithm, out, bucket_bytes) -> Handle:
    error, signature = None, None
    try:
        flat = [flat_view(a, f"buf[{i}]") for i, a in enumerate(arrays)]
        opx = get_op(op)
        if algorithm != "auto":
            get_algorithm(algorithm)
        if out is None:
            dests = arrays
        else:
            if not isinstance(out, (list, tuple)) or len(out) != len(arrays):
                raise TypeError("out must be a list with one array per input array")
            dests = list(out)
            for a, o in zip(arrays, dests):
                check_out(o, a, a.size, "buf")
        if any(read_only(d) for d in dests):
            raise ValueError("a result array is read-only; pass writeable arrays (or out=)")
        groups = buckets(flat, DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes)
        shape = [(len(g), sum(flat[i].size for i in g), str(flat[g[0]].dtype)) for g in groups]
        # auto: one lookup per bucket, by the bytes it reduces (select.choose)
        names = [algorithm if algorithm != "auto" else
                 select.choose(c, sum(reduced_bytes(flat[i]) for i in g)) for g in groups]
        signature = ("allreduce_async", ("buckets", tuple(shape)), ("op", opx.name),
                     ("algorithm", algorithm if algorithm != "auto" else ("auto", *names)))
    except (TypeError, ValueError) as exc:
        error = exc
    entry = guard.check(c, signature, error)
    worker = _worker(c)
    futures = []
    for g, name in zip(groups, names):
        if len(g) == 1:                 # one tensor: reduce it where it is, no packing
            i = g[0]
            dest = flat[i] if out is None else dests[i].reshape(-1)
            futures.append(worker.submit(run_allreduce, flat[i], dest, opx, name,
                                         arrays=(flat[i], dest)))
            continue
        packed = get_array_module(flat[g[0]]).concatenate([flat[i] for i in g])
        ends = [0]
        for i in g:
            ends.append(ends[-1] + flat[i].size)
        futures.append(worker.submit(_fused, packed, opx, name, [dests[i] for i in g],
                                     list(zip(ends[:-1], ends[1:])), arrays=(packed,)))
    return Handle(arrays if out is None else list(out), futures=futures, entry=entry)
