"""The Python half of the backend: one torch process group's collectives over one mpidist
Communicator, done on CPU tensors seen as NumPy arrays (zero-copy views).

The ProcessGroup (process_group.py) calls `Group.<name>(done, ...)` for each collective and
returns a Work at once; the collective runs on the group's worker thread, in call order (the same on every
rank), and ends with done(None) or done("Error: message"), which completes the Work and its
future. Reductions use mpidist's algorithms (the group's `algorithm`, "auto" by default: the
decision table's choice, as for every collective); on one node, float32/float64 allreduces
where that is "shm" (DDP's buckets) are reduced in the group's node window
(collectives.node) with no MPI call; with nothing queued ahead, such a one starts on the
calling thread and ends there when every rank has called within a short wait (else on the
worker: _begin_here). Data movement is in moves.py. Point-to-point
messages go on a duplicate communicator, are posted when torch calls send/recv, and complete
on a second thread, so an exchange where both ranks send first cannot deadlock.

Every collective passes the mismatch guard once (the digests at the node window's barrier on
one node, else guard.check), around algorithms that do not check again: ranks that
call different collectives, or pass tensors they disagree on, raise on every rank (through
Work.wait()) instead of hanging.
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from mpi4py import MPI

from mpidist.collectives import flight, guard, node, select
from mpidist.collectives.arrays import as_array
from mpidist.collectives.core import reduced_bytes, run_allreduce
from mpidist.collectives.node import reductions
from mpidist.collectives.ops import OPS, SUPPORTED_DTYPES, accumulator_dtype, get_op, narrow
from mpidist.collectives.waits import mark_patient
from mpidist.comm import Communicator
from mpidist.torch.backend import cuda
from mpidist.torch.backend.moves import Movement, parts
from mpidist.torch.backend.views import bytes_view, numpy_view

__all__ = ["Group"]

_MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX,
            "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}
_PATIENCE = 0.02      # seconds an allreduce begun on the caller's thread waits there for the others


def _op_route(op: str, dtype: np.dtype) -> str:
    """"mpidist" (its algorithms), "mpi" (MPI's reduction, for the small integer types and
    bitwise ops) or an error naming what is not supported."""
    if op in OPS and dtype in SUPPORTED_DTYPES:
        return "mpidist"
    if op in _MPI_OPS and dtype.kind in "iu" and op != "avg":
        return "mpi"
    if op == "unknown" or op not in _MPI_OPS and op not in OPS:
        raise ValueError(f"reduce op {op!r} is not implemented by the mpidist backend; "
                         f"use SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM or (integers) BAND, "
                         f"BOR, BXOR")
    raise TypeError(f"the mpidist backend does not reduce {dtype} with {op.upper()}; "
                    f"{', '.join(str(d) for d in SUPPORTED_DTYPES)} take every op, other "
                    f"integer types take SUM, PRODUCT, MIN, MAX and the bitwise ops")


def _graph_task() -> int:
    """The id of the backward this thread runs, -1 outside one (or where torch lacks it)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current is None else current()


class Group(Movement):
    """The collectives of one process group on `comm` (an mpidist Communicator it owns).

    algorithm: mpidist's allreduce algorithm for this group ("auto", "ring", "shm", ...).
    """

    def __init__(self, comm: Communicator, algorithm: str = "auto"):
        self.comm = comm
        self.algorithm = algorithm
        self.rank, self.size = comm.rank, comm.size
        self._p2p = comm.comm.Dup()
        threaded = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        # without MPI_THREAD_MULTIPLE everything runs inside the call, on the caller's thread;
        # with it, on a worker beside backward, whose MPI waits nap (collectives.waits): it
        # alone calls the group's collectives on comm, on every rank
        # once backward has ended (DDP then waits for its buckets), they stop napping until
        # the queue is empty: _hurry_after_backward
        self._backward_over = threading.Event()
        self._hooked_task = -1                  # the backward whose end is hooked
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mpidist-torch",
                                        initializer=mark_patient,
                                        initargs=(self._backward_over.is_set,)) \
            if threaded else None
        self._p2p_pool = ThreadPoolExecutor(1, thread_name_prefix="mpidist-torch-p2p") \
            if threaded else None
        # ranks sharing one node: the guard's digests and "shm" allreduces in their window
        self._window = node.window_of(comm) if node.usable(comm) else None
        self._lock = threading.Lock()
        self._queued = 0                        # collectives on the worker, not yet done

    # ------------------------------------------------------------------ machinery
    def _submit(self, done, fn, *args, pool=None) -> None:
        ready = cuda.ready_event(args)          # CUDA tensors: after torch's queued work

        def job():
            error = None
            try:
                if ready is None:
                    fn(*args)
                else:
                    ready.synchronize()
                    self._on_device(fn, args)
            except BaseException as exc:        # delivered by Work.wait() on this rank
                error = f"{type(exc).__name__}: {exc}"
            if queued:                          # before done: a wait()er may call again
                with self._lock:
                    self._queued -= 1
                    if self._queued == 0:
                        self._backward_over.clear()
            done(error)
        pool = pool or self._pool
        queued = pool is self._pool and pool is not None
        if pool is None:
            job()
            return
        if queued:
            with self._lock:
                self._queued += 1
            self._hurry_after_backward()
        pool.submit(job)

    def _hurry_after_backward(self) -> None:
        """Called inside backward (DDP's bucket hooks): when this backward ends, nothing on
        this rank computes until the collectives queued here are done, so from then the
        worker's waits do not nap (collectives.waits) until its queue is empty."""
        task = _graph_task()
        if task == -1 or task == self._hooked_task:
            return
        self._hooked_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        with self._lock:
            if self._queued:
                self._backward_over.set()

    def _on_device(self, fn, args) -> None:
        """fn(*args) with CUDA tensors: float32/float64 allreduces on mpidist's device path,
        the rest on host copies (cuda.py)."""
        if fn == self._allreduce and all(t.is_cuda and t.dtype in cuda.DEVICE_DTYPES
                                         for t in args[2]):
            op, factor, tensors = args
            for t in tensors:
                x = as_array(t.detach())
                with self._guarded(("torch.allreduce", ("n", x.size), ("dtype", str(x.dtype)),
                                    ("op", op), ("device", "cuda")), _device_op_error(op)):
                    if op == "premul_sum":
                        t.detach().mul_(factor)
                    self._run_allreduce(x, x, "sum" if op == "premul_sum" else op)
                torch.cuda.synchronize(t.device)         # the results are there at done()
            return
        with cuda.staged(args) as host:
            fn(*host)

    @contextlib.contextmanager
    def _guarded(self, signature, error=None):
        """The mismatch guard around one collective (raises on every rank when the ranks
        disagree or one has `error`); the flight recorder sees the call end."""
        entry = self._check(signature, error)
        try:
            yield
        finally:
            flight.end(entry)

    def _check(self, signature, error=None):
        """The guard's check, over the node's window where there is one (no MPI call)."""
        if self._window is not None and guard.get_mode() != "off":
            return self._window.check(signature, error)
        return guard.check(self.comm, signature, error)

    def _checked(self, kind: str, describe):
        """_guarded for a collective whose signature `describe()` computes (a ValueError or
        TypeError it raises is raised on every rank)."""
        error, signature = None, None
        try:
            signature = (f"torch.{kind}",) + tuple(describe())
        except (TypeError, ValueError) as exc:
            error = exc
        return self._guarded(signature, error)

    def shutdown(self) -> None:
        """Finish queued work and free the communicators (collective over the group)."""
        for pool in (self._pool, self._p2p_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._p2p_pool = None
        self._window = None                     # freed with the communicator
        if self._p2p != MPI.COMM_NULL:
            self._p2p.Free()
        self.comm.free()

    # ------------------------------------------------------------------ reductions
    def _plan(self, op: str, factor, t: torch.Tensor):
        """(x, op, scale, route, signature, error) of reducing t: its NumPy view, the op with
        PREMUL_SUM as SUM after a scale, mpidist's or MPI's reduction, the guard's signature,
        and the argument error to raise on every rank (or None)."""
        x, route, error, signature, scale = None, None, None, None, None
        try:
            x = numpy_view(t)
            route = _op_route("sum" if op == "premul_sum" else op, x.dtype)
            signature = ("torch.allreduce", ("n", x.size), ("dtype", str(x.dtype)),
                         ("op", op), ("algorithm", self.algorithm))
        except (TypeError, ValueError) as exc:
            error = exc
        if op == "premul_sum" and error is None:
            scale, op = float(factor), "sum"
        return x, op, scale, route, signature, error

    def _in_window(self, plan) -> bool:
        """Whether the allreduce of plan runs in the node window: float32/float64, no
        argument error, and the group's algorithm ("auto": the table's choice) is shm."""
        x, _, _, route, _, error = plan
        return (error is None and self._window is not None and route == "mpidist"
                and x.dtype in node.DTYPES and self._algorithm_for(x) == "shm")

    def _algorithm_for(self, x) -> str:
        """The group's algorithm for reducing x ("auto": the decision table's choice)."""
        if self.algorithm == "auto":
            return select.choose(self.comm, reduced_bytes(x))
        return self.algorithm

    def _reduce(self, op: str, factor, t: torch.Tensor, out=None) -> None:
        """Reduce t over the group, in place (or into out, a NumPy array like t's view)."""
        plan = self._plan(op, factor, t)
        x, op, scale, route, signature, error = plan
        if self._in_window(plan):
            reductions.allreduce(self._window, x, x if out is None else out, get_op(op),
                                 signature=signature, scale=scale)
            return
        with self._guarded(signature, error):
            if scale is not None:
                src = t if out is None else t.clone()
                x = numpy_view(src.mul_(scale))
            if route == "mpidist":
                self._run_allreduce(x, x if out is None else out, op)
            else:
                self.comm.comm.Allreduce(MPI.IN_PLACE if out is None else x,
                                         x if out is None else out, _MPI_OPS[op])

    def _run_allreduce(self, x, y, op: str) -> None:
        """mpidist's allreduce of x into y with the group's algorithm, after the group's own
        check (so the guard runs once)."""
        run_allreduce(self.comm, x, y, get_op(op), self._algorithm_for(x))

    def allreduce(self, done, op, factor, tensors) -> None:
        tensors = list(tensors)
        if len(tensors) == 1 and self._begin_here(done, op, factor, tensors[0]):
            return
        self._submit(done, self._allreduce, op, factor, tensors)

    def _begin_here(self, done, op, factor, t) -> bool:
        """An allreduce in the node's window, started on the calling thread when nothing is
        queued ahead of it: publish, then, if every rank has called within _PATIENCE, the
        rest here too; else the rest goes to the worker (so a caller never waits long for a
        rank that calls later, e.g. after a message from this one). Whether it started.

        Why: with a core per rank, the worker only takes turns with the caller's backward on
        one core; done here, the bucket costs no thread hand-offs and switches. Assumes one
        thread calls the group's collectives at a time (as one call order on every rank
        needs): two threads at once could both find the worker idle."""
        if self._pool is None or self._queued or t.device.type != "cpu":
            return False
        plan = self._plan(op, factor, t)
        if not self._in_window(plan) or not self._window.fits(plan[0].nbytes):
            return False
        x, op, scale, _, signature, _ = plan
        w = self._window
        try:
            call = reductions.begin(w, x, x, get_op(op), signature=signature, scale=scale)
            if not reductions.ready(w, call, _PATIENCE):
                self._submit(done, reductions.finish, w, call)
                return True
            reductions.finish(w, call)
        except BaseException as exc:            # delivered by Work.wait() on this rank
            done(f"{type(exc).__name__}: {exc}")
        else:
            done(None)
        return True

    def _allreduce(self, op, factor, tensors) -> None:
        for t in tensors:
            self._reduce(op, factor, t)

    def allreduce_coalesced(self, done, op, factor, tensors) -> None:
        self._submit(done, self._allreduce, op, factor, list(tensors))

    @cuda.on_host
    def reduce(self, done, op, factor, tensors, root, root_tensor) -> None:
        self._submit(done, self._reduce_to, op, factor, tensors[root_tensor], root)

    def _reduce_to(self, op, factor, t, root) -> None:
        # an allreduce; ranks other than root reduce into scratch (their tensor is kept)
        out = None if self.rank == root else np.empty_like(numpy_view(t))
        self._reduce(op, factor, t, out=out)

    @cuda.on_host
    def reduce_scatter(self, done, op, factor, outputs, input_lists) -> None:
        self._submit(done, self._reduce_scatter_lists, op, factor, outputs, input_lists)

    def _reduce_scatter_lists(self, op, factor, outputs, input_lists) -> None:
        for out, ins in zip(outputs, input_lists):
            error = None
            try:
                _count(ins, self.size)
            except ValueError as exc:
                error = exc
            flat = torch.cat([i.reshape(-1) for i in ins]) if error is None else out
            self._reduce_scatter(op, factor, out, flat, copy_ok=True, error=error)

    @cuda.on_host
    def reduce_scatter_base(self, done, op, factor, output, inp) -> None:
        self._submit(done, self._reduce_scatter, op, factor, output, inp)

    @cuda.on_host
    def reduce_scatter_tensor_coalesced(self, done, op, factor, outputs, inputs) -> None:
        def run():
            for out, inp in zip(outputs, inputs):
                self._reduce_scatter(op, factor, out, inp)
        self._submit(done, run)

    def _reduce_scatter(self, op, factor, out, inp, copy_ok=False, error=None) -> None:
        """out = my chunk of the reduction of inp (inp is left unchanged); error: an argument
        error found by the caller, raised on every rank."""
        route = None
        try:
            if error is not None:
                raise error
            x, y = numpy_view(inp), numpy_view(out)
            route = _op_route("sum" if op == "premul_sum" else op, x.dtype)
            if x.size != y.size * self.size:
                raise ValueError(f"reduce_scatter: the input has {x.size} elements, the "
                                 f"output {y.size}; the input must be {self.size} x the output")
        except (TypeError, ValueError) as exc:
            error = exc
        if op == "premul_sum" and error is None:
            inp = inp.mul_(factor) if copy_ok else inp * factor
            x, op = numpy_view(inp), "sum"
        with self._guarded(("torch.reduce_scatter", ("n", None if error else x.size),
                            ("dtype", None if error else str(x.dtype)), ("op", op)), error):
            if route == "mpidist":
                _reduce_scatter_into(self.comm, x, y, get_op(op))
            else:
                self.comm.comm.Reduce_scatter_block(x, y, _MPI_OPS[op])

    # ------------------------------------------------------------------ point to point
    def send(self, done, tensors, dst, tag) -> None:
        reqs = [self._p2p.Isend(bytes_view(t), dest=dst, tag=tag) for t in tensors]
        self._submit(done, MPI.Request.Waitall, reqs, pool=self._p2p_pool)

    def recv(self, done, tensors, src, tag) -> None:
        reqs = [self._p2p.Irecv(bytes_view(t), source=src, tag=tag) for t in tensors]
        self._submit(done, MPI.Request.Waitall, reqs, pool=self._p2p_pool)


def _reduce_scatter_into(comm, x, y, opx) -> None:
    """y = my chunk of x reduced over comm (x has size x y's elements); half precision is
    reduced in float32. The caller has checked the call."""
    acc = accumulator_dtype(x.dtype)
    if acc == x.dtype:
        parts(comm).reduce_scatter(comm, x, y, opx, finalize_n=comm.size)
        return
    wide = np.empty(y.size, acc)
    parts(comm).reduce_scatter(comm, x.astype(acc), wide, opx, finalize_n=comm.size)
    narrow(wide, y)


def _count(tensors, size: int) -> int:
    if len(tensors) != size:
        raise ValueError(f"reduce_scatter: {len(tensors)} input tensors, one per rank ({size}) "
                         f"expected")
    return len(tensors)


def _device_op_error(op: str):
    """The error of an allreduce op the device path does not take (else None)."""
    if op == "premul_sum" or op in OPS:
        return None
    return ValueError(f"the mpidist backend reduces CUDA tensors with SUM, AVG, PRODUCT, MIN, "
                      f"MAX or PREMUL_SUM, not {op.upper()}")
