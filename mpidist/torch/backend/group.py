"""The Python half of the backend: one torch process group's collectives over one mpidist
Communicator, done on CPU tensors seen as NumPy arrays (zero-copy views).

The C++ Backend calls `Group.<name>(done, ...)` for each collective and returns a Work at
once; the collective runs on the group's worker thread, in call order (the same on every
rank), and ends with done(None) or done("Error: message"), which completes the Work and its
future. Reductions use mpidist's algorithms (the group's `algorithm`, "auto" by default);
data movement (broadcast, gathers, scatter, all-to-all) uses MPI's own collectives on raw
bytes, so every dtype moves. Point-to-point messages go on a duplicate communicator, are
posted when torch calls send/recv, and complete on a second thread, so an exchange where
both ranks send first cannot deadlock.

Every collective passes the mismatch guard first: ranks that call different collectives, or
pass tensors they disagree on, raise on every rank (through Work.wait()) instead of hanging.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import torch
from mpi4py import MPI

from mpidist.collectives import allgather, allreduce, flight, guard, reduce_scatter
from mpidist.collectives.ops import OPS, SUPPORTED_DTYPES
from mpidist.comm import Communicator

__all__ = ["Group", "numpy_view"]

_MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX,
            "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}
_CARRIERS = (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.float16))  # moved as bits


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """The 1-D NumPy view of a contiguous CPU tensor (no copy; bfloat16 as ml_dtypes')."""
    if t.device.type != "cpu":
        raise TypeError(f"the mpidist backend takes CPU tensors, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("the mpidist backend takes contiguous tensors; pass t.contiguous() "
                         "(and copy the result back)")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).reshape(-1)
    return t.numpy().reshape(-1)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return numpy_view(t).view(np.uint8)


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


class Group:
    """The collectives of one process group on `comm` (an mpidist Communicator it owns).

    algorithm: mpidist's allreduce algorithm for this group ("auto", "ring", "shm", ...).
    """

    def __init__(self, comm: Communicator, algorithm: str = "auto"):
        self.comm = comm
        self.algorithm = algorithm
        self.rank, self.size = comm.rank, comm.size
        self._p2p = comm.comm.Dup()
        threaded = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        # without MPI_THREAD_MULTIPLE everything runs inside the call, on the caller's thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mpidist-torch") \
            if threaded else None
        self._p2p_pool = ThreadPoolExecutor(1, thread_name_prefix="mpidist-torch-p2p") \
            if threaded else None

    # ------------------------------------------------------------------ machinery
    def _submit(self, done, fn, *args, pool=None) -> None:
        def job():
            try:
                fn(*args)
            except BaseException as exc:        # delivered by Work.wait() on this rank
                done(f"{type(exc).__name__}: {exc}")
            else:
                done(None)
        pool = pool or self._pool
        if pool is None:
            job()
        else:
            pool.submit(job)

    @contextlib.contextmanager
    def _guarded(self, signature, error=None):
        """The mismatch guard around one collective (raises on every rank when the ranks
        disagree or one has `error`); the flight recorder sees the call end."""
        entry = guard.check(self.comm, signature, error)
        try:
            yield
        finally:
            flight.end(entry)

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
        if self._p2p != MPI.COMM_NULL:
            self._p2p.Free()
        self.comm.free()

    # ------------------------------------------------------------------ reductions
    def _reduce(self, op: str, factor, t: torch.Tensor, out=None) -> None:
        """Reduce t over the group, in place (or into out, a NumPy array like t's view)."""
        route, error = None, None
        try:
            x = numpy_view(t)
            route = _op_route("sum" if op == "premul_sum" else op, x.dtype)
        except (TypeError, ValueError) as exc:
            error = exc
        if op == "premul_sum" and error is None:
            src = t if out is None else t.clone()
            src.mul_(factor)
            x, op = numpy_view(src), "sum"
        if error is None and route == "mpidist":      # mpidist's allreduce guards itself
            allreduce(x, op=op, algorithm=self.algorithm, comm=self.comm, out=out)
            return
        with self._guarded(("torch.reduce", ("n", None if error else x.size),
                            ("dtype", None if error else str(x.dtype)), ("op", op)), error):
            self.comm.comm.Allreduce(MPI.IN_PLACE if out is None else x,
                                     x if out is None else out, _MPI_OPS[op])

    def allreduce(self, done, op, factor, tensors) -> None:
        self._submit(done, self._allreduce, op, factor, list(tensors))

    def _allreduce(self, op, factor, tensors) -> None:
        for t in tensors:
            self._reduce(op, factor, t)

    def allreduce_coalesced(self, done, op, factor, tensors) -> None:
        self._submit(done, self._allreduce, op, factor, list(tensors))

    def reduce(self, done, op, factor, tensors, root, root_tensor) -> None:
        self._submit(done, self._reduce_to, op, factor, tensors[root_tensor], root)

    def _reduce_to(self, op, factor, t, root) -> None:
        # an allreduce; ranks other than root reduce into scratch (their tensor is kept)
        out = None if self.rank == root else np.empty_like(numpy_view(t))
        self._reduce(op, factor, t, out=out)

    def reduce_scatter(self, done, op, factor, outputs, input_lists) -> None:
        self._submit(done, self._reduce_scatter_lists, op, factor, outputs, input_lists)

    def _reduce_scatter_lists(self, op, factor, outputs, input_lists) -> None:
        for out, ins in zip(outputs, input_lists):
            with self._checked("reduce_scatter", lambda: (
                    ("tensors", _count(ins, self.size, "reduce_scatter inputs")),)):
                pass
            self._reduce_scatter(op, factor, out, torch.cat([i.reshape(-1) for i in ins]),
                                 copy_ok=True)

    def reduce_scatter_base(self, done, op, factor, output, inp) -> None:
        self._submit(done, self._reduce_scatter, op, factor, output, inp)

    def reduce_scatter_tensor_coalesced(self, done, op, factor, outputs, inputs) -> None:
        def run():
            for out, inp in zip(outputs, inputs):
                self._reduce_scatter(op, factor, out, inp)
        self._submit(done, run)

    def _reduce_scatter(self, op, factor, out, inp, copy_ok=False) -> None:
        """out = my chunk of the reduction of inp (inp is left unchanged)."""
        route, error = None, None
        try:
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
        if error is None and route == "mpidist":      # mpidist's reduce_scatter guards itself
            reduce_scatter(x, op=op, comm=self.comm, out=y)
            return
        with self._guarded(("torch.reduce_scatter", ("n", None if error else x.size),
                            ("op", op)), error):
            self.comm.comm.Reduce_scatter_block(x, y, _MPI_OPS[op])

    # ------------------------------------------------------------------ data movement
    def broadcast(self, done, tensors, root, root_tensor) -> None:
        def run():
            for t in tensors:
                with self._checked("broadcast", lambda: (("nbytes", _bytes(t).size),
                                                         ("root", root))):
                    self.comm.comm.Bcast(_bytes(t), root=root)
        self._submit(done, run)

    def _allgather_bytes(self, src: np.ndarray, dst: np.ndarray) -> None:
        """dst (size x src's bytes) = every rank's src, in rank order: mpidist's allgather
        on a carrier dtype that divides the length, else MPI_Allgather of bytes."""
        carrier = next((d for d in _CARRIERS if src.size % d.itemsize == 0), None)
        if carrier is not None and dst.size == src.size * self.size:
            allgather(src.view(carrier), out=dst.view(carrier), comm=self.comm)
            return
        with self._checked("allgather", lambda: _same_size("allgather", src, dst, self.size)):
            self.comm.comm.Allgather(src, dst)

    def allgather_base(self, done, output, inp) -> None:
        self._submit(done, self._allgather_base, output, inp)

    def _allgather_base(self, output, inp) -> None:
        src, dst = _bytes(inp), _bytes(output)
        with self._checked("allgather_base",
                           lambda: _same_size("allgather", src, dst, self.size)):
            pass
        self._allgather_bytes(src, dst)

    def allgather_into_tensor_coalesced(self, done, outputs, inputs) -> None:
        def run():
            for out, inp in zip(outputs, inputs):
                self._allgather_base(out, inp)
        self._submit(done, run)

    def allgather(self, done, output_lists, inputs) -> None:
        self._submit(done, self._allgather_lists, output_lists, inputs)

    def allgather_coalesced(self, done, output_lists, inputs) -> None:
        self._submit(done, self._allgather_lists, output_lists, inputs)

    def _allgather_lists(self, output_lists, inputs) -> None:
        for outs, inp in zip(output_lists, inputs):
            src = _bytes(inp)
            with self._checked("allgather", lambda: _list_of(outs, src, self.size, "allgather")):
                pass
            dst = np.empty(src.size * self.size, np.uint8)
            self._allgather_bytes(src, dst)
            for r, o in enumerate(outs):
                _bytes(o)[...] = dst[r * src.size:(r + 1) * src.size]

    def gather(self, done, output_lists, inputs, root) -> None:
        def run():
            for i, inp in enumerate(inputs):
                src = _bytes(inp)
                outs = output_lists[i] if self.rank == root else []
                dst = np.empty(src.size * self.size, np.uint8) if self.rank == root else None
                with self._checked("gather", lambda: (
                        _list_of(outs, src, self.size, "gather", self.rank == root) +
                        (("root", root),))):
                    self.comm.comm.Gather(src, dst, root=root)
                for r, o in enumerate(outs):
                    _bytes(o)[...] = dst[r * src.size:(r + 1) * src.size]
        self._submit(done, run)

    def scatter(self, done, outputs, input_lists, root) -> None:
        def run():
            for i, out in enumerate(outputs):
                dst = _bytes(out)
                ins = input_lists[i] if self.rank == root else []
                with self._checked("scatter", lambda: (
                        _list_of(ins, dst, self.size, "scatter", self.rank == root) +
                        (("root", root),))):
                    src = np.concatenate([_bytes(t) for t in ins]) if self.rank == root \
                        else None
                    self.comm.comm.Scatter(src, dst, root=root)
        self._submit(done, run)

    def _alltoallv(self, src, send_counts, dst, recv_counts) -> None:
        """MPI_Alltoallv of bytes, after checking that every pair agrees on its counts."""
        error = None
        try:
            theirs = self.comm.comm.alltoall(list(send_counts))
            if list(theirs) != list(recv_counts):
                bad = [r for r in range(self.size) if theirs[r] != recv_counts[r]]
                raise ValueError(f"alltoall: rank {self.rank} expects {list(recv_counts)} "
                                 f"bytes from ranks 0..{self.size - 1} but ranks {bad} "
                                 f"send {[theirs[r] for r in bad]}")
        except ValueError as exc:
            error = exc
        self.comm.raise_if_any(error)
        self.comm.comm.Alltoallv([src, (send_counts, _displs(send_counts)), MPI.BYTE],
                                 [dst, (recv_counts, _displs(recv_counts)), MPI.BYTE])

    def alltoall_base(self, done, output, inp, output_splits, input_splits) -> None:
        def run():
            counts = {}

            def describe():
                counts["send"] = _split_bytes(inp, input_splits, self.size)
                counts["recv"] = _split_bytes(output, output_splits, self.size)
                return (("dtype", str(inp.dtype)),)
            with self._checked("alltoall_base", describe):
                self._alltoallv(_bytes(inp), counts["send"], _bytes(output), counts["recv"])
        self._submit(done, run)

    def alltoall(self, done, outputs, inputs) -> None:
        def run():
            with self._checked("alltoall", lambda: (
                    ("tensors", _count(inputs, self.size, "alltoall inputs"),
                     _count(outputs, self.size, "alltoall outputs")),)):
                src = np.concatenate([_bytes(t) for t in inputs])
                dst = np.empty(sum(_bytes(t).size for t in outputs), np.uint8)
                self._alltoallv(src, [_bytes(t).size for t in inputs], dst,
                                [_bytes(t).size for t in outputs])
            at = 0
            for t in outputs:
                b = _bytes(t)
                b[...] = dst[at:at + b.size]
                at += b.size
        self._submit(done, run)

    def barrier(self, done) -> None:
        def run():
            with self._checked("barrier", tuple):
                self.comm.comm.Barrier()
        self._submit(done, run)

    # ------------------------------------------------------------------ point to point
    def send(self, done, tensors, dst, tag) -> None:
        reqs = [self._p2p.Isend(_bytes(t), dest=dst, tag=tag) for t in tensors]
        self._submit(done, MPI.Request.Waitall, reqs, pool=self._p2p_pool)

    def recv(self, done, tensors, src, tag) -> None:
        reqs = [self._p2p.Irecv(_bytes(t), source=src, tag=tag) for t in tensors]
        self._submit(done, MPI.Request.Waitall, reqs, pool=self._p2p_pool)


def _count(tensors, size: int, what: str) -> int:
    if len(tensors) != size:
        raise ValueError(f"{what}: {len(tensors)} tensors, one per rank ({size}) expected")
    return len(tensors)


def _same_size(kind: str, src, dst, size: int) -> tuple:
    if dst.size != src.size * size:
        raise ValueError(f"{kind}: the output has {dst.size} bytes, {size} x the input's "
                         f"{src.size} expected")
    return (("nbytes", src.size),)


def _list_of(tensors, one, size: int, kind: str, check: bool = True) -> tuple:
    """Check (when `check`) a list of `size` tensors, each of one's byte length; the
    signature part is the same on every rank."""
    if check:
        _count(tensors, size, kind)
    if check and any(_bytes(t).size != one.size for t in tensors):
        raise ValueError(f"{kind}: every tensor in the list must have the byte size of the "
                         f"input ({one.size})")
    return (("nbytes", one.size),)


def _displs(counts) -> list[int]:
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out


def _split_bytes(t: torch.Tensor, splits, size: int) -> list[int]:
    """Byte counts per rank of t split along dim 0 (equal parts when splits is empty)."""
    rows = t.shape[0] if t.dim() else 1
    row = t.numel() * t.element_size() // rows if rows else 0
    if not splits:
        if rows % size:
            raise ValueError(f"alltoall: dim 0 ({rows}) does not divide into {size} ranks; "
                             f"pass split sizes")
        return [rows // size * row] * size
    if len(splits) != size or sum(splits) != rows:
        raise ValueError(f"alltoall: split sizes {list(splits)} must be {size} numbers "
                         f"summing to dim 0 ({rows})")
    return [s * row for s in splits]
