"""1-bit Adam and 1-bit LAMB (mpidist.optim.onebit) for torch modules.

During the warm-up (the optimizer's first freeze_step steps) the gradients go through the
data-parallel or ZeRO-1 exchange as they always do. Once the optimizer is frozen no bucket
goes out while backward runs; step() hands this rank's whole gradient to the momentum
exchange of mpidist.strategy.onebit (local momentum, compressed reduce-scatter with worker
error feedback, server error feedback on each chunk, allgather), as the NumPy data-parallel
and ZeRO-1 engines do, and the optimizer updates from the averaged momentum. The error
feedback state is the driver's, kept per buffer range (here one: the whole gradient).
"""
from __future__ import annotations

import numpy as np

from mpidist.strategy.onebit import OnebitDriver

__all__ = ["Onebit"]


class Onebit:
    """The exchange interface of mpidist.torch.exchange around a data-parallel or ZeRO-1
    exchange `inner`, for a 1-bit optimizer over inner's shard (collective construction).

    mult: what this rank's gradient is multiplied by to estimate the gradient the update
    takes (1 for op="avg", the rank count for op="sum")."""

    def __init__(self, inner, optimizer, layout, comm, *, mult: float):
        self.inner, self.storage = inner, inner.storage
        optimizer.reduce_max = inner.reduce_max      # 1-bit LAMB's maximum over the shards
        self.driver = OnebitDriver(optimizer, layout, comm, mult=mult)

    @property
    def frozen(self) -> bool:
        """True once the warm-up is over: the momentum goes instead of the gradients."""
        return self.driver.frozen

    def in_window(self) -> bool:
        return not self.frozen and self.inner.in_window()

    def owned(self, lo: int, hi: int) -> tuple[int, int]:
        return self.inner.owned(lo, hi)

    def launch(self, lo: int, hi: int, own=()):
        return None if self.frozen else self.inner.launch(lo, hi, own)

    def launched(self) -> None:
        if not self.frozen:
            self.inner.launched()

    def settle(self) -> None:
        self.inner.settle()

    def wait(self, bounds, handle) -> None:
        self.inner.wait(bounds, handle)

    def complete(self) -> bool | None:
        return None if self.frozen else self.inner.complete()

    def gather_grads(self) -> None:
        if not self.frozen:
            self.inner.gather_grads()

    def update(self, optimizer, scale: float) -> dict:
        if not self.frozen:
            return self.inner.update(optimizer, scale)
        g = self.storage.grads
        g = g if g.dtype == np.float32 else g.astype(np.float32)   # overwritten: momentum
        a, b = self.inner.shard
        out = self.driver.step(self.storage.params[a:b], g, finite=True,
                               reduce_norms=self.inner.reduce_norms)
        self.inner.gather_params()
        return {"lr": out.lr, "optim_step": out.step}
