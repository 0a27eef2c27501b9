"""The data-moving collectives of a process group (broadcast, gathers, scatter, all-to-all,
barrier), a part of Group: MPI's own collectives, or mpidist's allgather, on raw bytes, so
every dtype moves. Each checks its arguments under the group's guard first (_checked), so
a rank with a wrong argument or a different call raises on every rank.
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from mpidist.collectives import ring, shm
from mpidist.torch.backend.cuda import on_host
from mpidist.torch.backend.views import bytes_view

__all__ = ["Movement", "parts"]

_CARRIERS = (np.dtype(np.uint64), np.dtype(np.uint32), np.dtype(np.uint16))  # bits


class Movement:
    """Group's data movement; Group provides comm, rank, size, _submit and _checked."""

    @on_host
    def broadcast(self, done, tensors, root, root_tensor) -> None:
        def run():
            for t in tensors:
                with self._checked("broadcast", lambda: (("nbytes", bytes_view(t).size),
                                                         ("root", root))):
                    self.comm.comm.Bcast(bytes_view(t), root=root)
        self._submit(done, run)

    def _allgather_bytes(self, src: np.ndarray, dst: np.ndarray, describe) -> None:
        """dst (size x src's bytes) = every rank's src, in rank order, checked once under
        describe() (which checks the caller's arguments: a ValueError raises on every rank):
        mpidist's allgather on a carrier dtype that divides the length, else MPI_Allgather
        of bytes."""
        carrier = next((d for d in _CARRIERS if src.size % d.itemsize == 0), None)
        with self._checked("allgather", describe):
            if carrier is None:
                self.comm.comm.Allgather(src, dst)
            else:
                parts(self.comm).allgather(self.comm, src.view(carrier), dst.view(carrier))

    @on_host
    def allgather_base(self, done, output, inp) -> None:
        self._submit(done, self._allgather_base, output, inp)

    def _allgather_base(self, output, inp) -> None:
        src, dst = bytes_view(inp), bytes_view(output)
        self._allgather_bytes(src, dst, lambda: _same_size("allgather", src, dst, self.size))

    @on_host
    def allgather_into_tensor_coalesced(self, done, outputs, inputs) -> None:
        def run():
            for out, inp in zip(outputs, inputs):
                self._allgather_base(out, inp)
        self._submit(done, run)

    @on_host
    def allgather(self, done, output_lists, inputs) -> None:
        self._submit(done, self._allgather_lists, output_lists, inputs)

    @on_host
    def allgather_coalesced(self, done, output_lists, inputs) -> None:
        self._submit(done, self._allgather_lists, output_lists, inputs)

    def _allgather_lists(self, output_lists, inputs) -> None:
        for outs, inp in zip(output_lists, inputs):
            src = bytes_view(inp)
            dst = np.empty(src.size * self.size, np.uint8)
            self._allgather_bytes(src, dst, lambda: _list_of(outs, src, self.size, "allgather"))
            for r, o in enumerate(outs):
                bytes_view(o)[...] = dst[r * src.size:(r + 1) * src.size]

    @on_host
    def gather(self, done, output_lists, inputs, root) -> None:
        def run():
            for i, inp in enumerate(inputs):
                src = bytes_view(inp)
                outs = output_lists[i] if self.rank == root else []
                dst = np.empty(src.size * self.size, np.uint8) if self.rank == root else None
                with self._checked("gather", lambda: (
                        _list_of(outs, src, self.size, "gather", self.rank == root) +
                        (("root", root),))):
                    self.comm.comm.Gather(src, dst, root=root)
                for r, o in enumerate(outs):
                    bytes_view(o)[...] = dst[r * src.size:(r + 1) * src.size]
        self._submit(done, run)

    @on_host
    def scatter(self, done, outputs, input_lists, root) -> None:
        def run():
            for i, out in enumerate(outputs):
                dst = bytes_view(out)
                ins = input_lists[i] if self.rank == root else []
                with self._checked("scatter", lambda: (
                        _list_of(ins, dst, self.size, "scatter", self.rank == root) +
                        (("root", root),))):
                    src = np.concatenate([bytes_view(t) for t in ins]) if self.rank == root \
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

    @on_host
    def alltoall_base(self, done, output, inp, output_splits, input_splits) -> None:
        def run():
            counts = {}

            def describe():
                counts["send"] = _splitbytes_view(inp, input_splits, self.size)
                counts["recv"] = _splitbytes_view(output, output_splits, self.size)
                return (("dtype", str(inp.dtype)),)
            with self._checked("alltoall_base", describe):
                self._alltoallv(bytes_view(inp), counts["send"], bytes_view(output), counts["recv"])
        self._submit(done, run)

    @on_host
    def alltoall(self, done, outputs, inputs) -> None:
        def run():
            with self._checked("alltoall", lambda: (
                    ("tensors", _count(inputs, self.size, "alltoall inputs"),
                     _count(outputs, self.size, "alltoall outputs")),)):
                src = np.concatenate([bytes_view(t) for t in inputs])
                dst = np.empty(sum(bytes_view(t).size for t in outputs), np.uint8)
                self._alltoallv(src, [bytes_view(t).size for t in inputs], dst,
                                [bytes_view(t).size for t in outputs])
            at = 0
            for t in outputs:
                b = bytes_view(t)
                b[...] = dst[at:at + b.size]
                at += b.size
        self._submit(done, run)

    def barrier(self, done) -> None:
        def run():
            with self._checked("barrier", tuple):
                self.comm.comm.Barrier()
        self._submit(done, run)


def parts(comm):
    """The reduce-scatter/allgather algorithm module of mpidist's "auto" on comm: the
    shared window within one node of three or more ranks, else the ring."""
    return shm if shm.preferred(comm) else ring


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
    if check and any(bytes_view(t).size != one.size for t in tensors):
        raise ValueError(f"{kind}: every tensor in the list must have the byte size of the "
                         f"input ({one.size})")
    return (("nbytes", one.size),)


def _displs(counts) -> list[int]:
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out


def _splitbytes_view(t: torch.Tensor, splits, size: int) -> list[int]:
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
