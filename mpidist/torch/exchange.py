"""How a DistributedOptimizer's gradient buckets are reduced and its parameters updated:
data parallel (every rank the whole sum, every rank the whole update).

An exchange serves GradientBuckets and the optimizer's step:
    in_window() -> bool                  this round's buckets are summed in the shared window
    owned(lo, hi) -> (a, b)              (in_window) the part of a bucket my launch may read
                                         from autograd's tensors instead of the buffer
    launch(lo, hi, own) -> handle|None   a bucket's gradients are final (in bucket order);
                                         own: (start, array) pieces of owned(lo, hi)
    launched()                           every bucket of the round is launched
    wait((lo, hi), handle)               step(): that bucket's reduction is needed now
    complete() -> bool | None            after the last wait (late collectives): whether the
                                         sums are finite on every rank (in_window), else
                                         None (the hooks checked)
    update(optimizer, scale) -> info     the optimizer step on the reduced gradients;
                                         scale: what the summed gradients are divided by
    settle()                             before the gradient buffer is written again: no
                                         rank still reads mine (the window's fence, queued
                                         at launched(), so that it overlaps the update)
    gather_grads()                       a caller's synchronize() is done: every rank's
                                         `.grad` the whole reduced gradient (collective)
Where the node's shared window is used (storage.shared), gradients are reduced where they
lie, checked for Inf/NaN as they are summed; else through mpidist.collectives (or a
compressor of mpidist.compress), which take CuPy arrays (a CUDA model's buffers) as they
are, or staged through pinned host memory where MPI is not CUDA-aware.
"""
from __future__ import annotations

import torch

from mpidist.collectives import allreduce_async
from mpidist.torch.tensors import torch_stream

__all__ = ["Allreduce"]


class Allreduce:
    """Data parallel: each bucket summed over the ranks (window, collectives or a
    compressor), then the whole buffer updated on every rank.

    shard: the range the optimizer updates (here all); reduce_norms / reduce_max: how
    per-tensor partial results are combined over the shards (None: one shard)."""

    reduce_norms = None
    reduce_max = None

    def __init__(self, storage, comm, *, algorithm: str = "auto", compressed=None):
        self.storage, self.comm = storage, comm
        self.algorithm, self.compressed = algorithm, compressed
        self.shard = (0, storage.layout.numel)
        self._nonfinite = 0             # the window's count of non-finite chunks, last seen
        self._fence = None

    def in_window(self) -> bool:
        return self.storage.shared is not None

    def owned(self, lo: int, hi: int) -> tuple[int, int]:
        return self.storage.shared.chunk_of(lo, hi)

    def launch(self, lo: int, hi: int, own=()):
        if self.comm.size == 1:
            return None
        buf = self.storage.grads[lo:hi]
        if self.storage.shared is not None:
            return self.storage.shared.allreduce_async(lo, hi, own)
        if self.compressed is not None:      # in the hook: on the bucket worker beside
            # backward it measured slower (its NumPy work competes with backward's cores)
            return self.compressed.allreduce_async(buf, op="sum", inplace=True,
                                                   layout=self.storage.layout)
        return allreduce_async(buf, op="sum", algorithm=self.algorithm, comm=self.comm)

    def launched(self) -> None:
        if self.storage.shared is not None:
            self._fence = self.storage.shared.fence_async()

    def settle(self) -> None:
        if self._fence is not None:
            self._fence.wait()
            self._fence = None

    def wait(self, bounds, handle) -> None:
        handle.wait()                            # every path sums in place

    def complete(self) -> bool | None:
        shared = self.storage.shared
        if shared is None:
            return None
        finite, self._nonfinite = shared.nonfinite == self._nonfinite, shared.nonfinite
        return finite

    def update(self, optimizer, scale: float) -> dict:
        if isinstance(optimizer, torch.optim.Optimizer):
            self.settle()                        # it may write into the gradients
            if scale != 1.0:
                self.storage.tgrads.mul_(1.0 / scale)
            optimizer.step()
            return {}
        with torch_stream(self.storage.device):  # CUDA: ordered before the next forward
            out = optimizer.step(self.storage.params, self.storage.grads, finite=True,
                                 loss_scale=scale)
        return {"lr": out.lr, "optim_step": out.step}

    def gather_grads(self) -> None:
        """After a caller's synchronize(): nothing to gather, every rank holds the sums."""

    def gather_params(self) -> None:
        """After an update of the shard: nothing to gather, every rank updated all."""
