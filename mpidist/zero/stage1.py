"""ZeRO stage 1 (P_os): optimizer states partitioned; parameters and gradients whole.

    1. forward/backward on the whole parameters into the whole gradient buffer
    2. reduce-scatter of the gradients: my shard of the sum lands in my chunk of them
       (with compression: the CompressedAllreduce of the whole buffer, my chunk kept)
    3. the optimizer updates my shard (its fp32 master and states exist for it alone)
    4. allgather of the updated shards into the whole parameter buffer

Communication: reduce-scatter + allgather = one allreduce, as much as data parallel.
Memory per parameter: 2 + 2 + 12/N bytes with mixed-precision Adam.
See docs/ARCHITECTURE.md (ZeRO).
"""
from __future__ import annotations

import time

import numpy as np

from mpidist.collectives import allgather, reduce_scatter
from mpidist.flat import FlatBuffer
from mpidist.zero.engine import ZeroEngine

__all__ = ["Stage1"]


class Stage1(ZeroEngine):
    """ZeRO stage 1: optimizer states sharded; gradients allreduced, parameters allgathered."""
    stage = 1

    def _setup(self, rng) -> None:
        self.params = FlatBuffer(self.layout, dtype=self.dtype, xp=self.xp)
        self.grads = FlatBuffer(self.layout, dtype=self.dtype, xp=self.xp)
        self.model.bind(self.params.views(), self.grads.views())
        self.model.init_params(rng)

    def param_shard(self):
        """My shard of the parameters (a view)."""
        return self.params.data[self.offset:self.offset + self.count]

    def grad_shard(self):
        """My shard of the summed gradients (a view)."""
        return self.grads.data[self.offset:self.offset + self.count]

    def _held(self):
        return [self.params.data], [self.grads.data]

    def _begin_step(self) -> None:
        self.grads.data[...] = 0

    def _finish_grads(self) -> None:
        if self.sends_momentum:       # a 1-bit optimizer sends its momentum in train_step
            return
        if self.compression is not None:
            self._compressed_grads()
            return
        # 2. reduce-scatter: my chunk of the flat buffer is my shard; the sum is written there
        t = time.perf_counter()
        summed = self.inflight.add(reduce_scatter(self.grads.data, op="sum", comm=self.comm))
        self.t_comm += time.perf_counter() - t
        self.grad_shard()[...] = summed
        self.inflight.drop(summed)

    def _compressed_grads(self) -> None:
        # 2. (compressed) the sum of every rank's compressed gradient, as the dp strategy's
        #    one-bucket exchange; half-precision gradients are compressed from float32; an
        #    inf/NaN anywhere comes back NaN, so step 3 skips on every rank
        t = time.perf_counter()
        g = self.grads.data
        if g.dtype != np.float32:
            g = g.astype(np.float32)
        summed = self.compression.allreduce_async(g, op="sum", layout=self.layout).wait()
        self.t_comm += time.perf_counter() - t
        self.grad_shard()[...] = summed[self.offset:self.offset + self.count]

    def _publish_params(self) -> None:
        # 4. allgather the updated shards in place (the ring allgather leaves my chunk alone)
        allgather(self.param_shard(), comm=self.comm, out=self.params.data, algorithm="ring")
