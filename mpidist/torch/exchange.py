"""How a DistributedOptimizer's gradient buckets are reduced and its parameters updated:
data parallel (every rank the whole sum, every rank the whole update).

An exchange serves GradientBuckets and the optimizer's step:
    launch(lo, hi) -> handle or None     a bucket's gradients are final (in bucket order)
    wait((lo, hi), handle)               step(): that bucket's reduction is needed now
    complete()                           after the last wait (window fence, late collectives)
    update(optimizer, scale) -> info     the optimizer step on the reduced gradients;
                                         scale: what the summed gradients are divided by
Where the node's shared window is used (storage.shared), gradients are reduced where they
lie; else through mpidist.collectives (or a compressor of mpidist.compress).
"""
from __future__ import annotations

import torch

from mpidist.collectives import allreduce_async
from mpidist.torch.tensors import from_numpy

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

    def launch(self, lo: int, hi: int):
        if self.comm.size == 1:
            return None
        buf = self.storage.grads[lo:hi]
        if self.storage.shared is not None:
            return self.storage.shared.allreduce_async(lo, hi)
        if self.compressed is not None:
            return self.compressed.allreduce_async(buf, op="sum",
                                                   layout=self.storage.layout)
        return allreduce_async(buf, op="sum", algorithm=self.algorithm, comm=self.comm)

    def wait(self, bounds, handle) -> None:
        out = handle.wait()
        if self.compressed is not None:          # a new array: the compressed sum
            lo, hi = bounds
            self.storage.grads[lo:hi] = out

    def complete(self) -> None:
        if self.storage.shared is not None:
            self.storage.shared.fence()          # nobody reads my gradients any more

    def update(self, optimizer, scale: float) -> dict:
        if isinstance(optimizer, torch.optim.Optimizer):
            if scale != 1.0:
                from_numpy(self.storage.grads).mul_(1.0 / scale)
            optimizer.step()
            return {}
        out = optimizer.step(self.storage.params, self.storage.grads, finite=True,
                             loss_scale=scale)
        return {"lr": out.lr, "optim_step": out.step}

    def gather_params(self) -> None:
        """After an update of the shard: nothing to gather, every rank updated all."""
