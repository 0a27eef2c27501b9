"""ZeRO stage 3 (P_os+g+p): optimizer states, gradients and parameters partitioned.

A rank keeps only its shard of everything. Forward and backward gather each layer's
parameters around its compute (the next layer's allgather prefetched during this one's),
backward reduce-scatters each complete gradient bucket onto its owners, and the optimizer
updates my shard; nothing is broadcast, the next forward gathers what it needs.
Communication: allgather (forward) + allgather (backward) + reduce-scatter = 1.5x data
parallel. Memory per parameter: 16/N bytes with mixed-precision Adam, plus the layers and
buckets in flight. Initial parameters are made one layer at a time with the same random
stream as model.init_params, so no rank ever holds the whole model.
See docs/ARCHITECTURE.md (ZeRO).
"""
from __future__ import annotations

from mpidist.zero.engine import ZeroEngine
from mpidist.zero.exchange import allgather_start
from mpidist.zero.stage2 import GradBuckets
from mpidist.zero.units import LayerHooks

__all__ = ["Stage3", "ParamGather"]


class ParamGather:
    """Parameters of the layers in use, gathered from their shards, with one-ahead prefetch.

    plan: the order in which layers are expected (the previous forward's order, or this
    forward's reversed for backward). Acquiring the layer at the plan's position starts the
    gather of the next one; a layer the plan did not predict is gathered on the spot. Every
    rank runs the same model code, so every rank starts the same gathers in the same order.
    """

    def __init__(self, engine, shard):
        self.e, self.shard = engine, shard
        self.cache: dict = {}
        self.plan: list = []
        self.pos = 0

    def begin(self, plan) -> None:
        """Start a phase expecting the layers in `plan` order (leftovers released first)."""
        self.end_phase()
        self.plan, self.pos = list(plan), 0

    def _fetch(self, unit):
        pending = self.cache.get(unit.index)
        if pending is None:
            pending = allgather_start(self.e.comm, self.e.shards, self.shard, unit.lo, unit.hi)
            self.e.inflight.add(*pending.buffers)
            self.cache[unit.index] = pending
        return pending

    def acquire(self, unit) -> None:
        pending = self._fetch(unit)
        if self.pos < len(self.plan) and self.plan[self.pos] is unit:
            self.pos += 1
            if self.pos < len(self.plan):
                self._fetch(self.plan[self.pos])          # prefetch: overlaps unit's compute
        unit.bind_params(self.e.timed_wait(pending))

    def release(self, unit) -> None:
        pending = self.cache.pop(unit.index, None)
        unit.bind_params(None)
        if pending is not None:
            self.e.timed_wait(pending)
            self.e.inflight.drop(*pending.buffers)

    def end_phase(self) -> None:
        """Release prefetched layers the phase did not use (all ranks alike)."""
        for index in sorted(self.cache):
            self.release(self.e.units[index])


class Stage3(ZeroEngine):
    """ZeRO stage 3: optimizer states, gradients and parameters sharded (layers gathered on use)."""
    stage = 3

    def _setup(self, rng) -> None:
        self.pshard = self.xp.zeros(self.count, dtype=self.dtype)
        self.model.bind(self._placeholders(self.dtype), self._placeholders(self.dtype))
        with LayerHooks(self.units, pre_reset=self._pre_reset, post_reset=self._post_reset):
            self.model.init_params(rng)
        self.grads = GradBuckets(self, self.xp.zeros(self.count, dtype=self.dtype))
        self.gather = ParamGather(self, self.pshard)
        self.forward_order: list = []
        self._recording: list = []
        self.hooks = LayerHooks(self.units, pre_forward=self._pre_forward,
                                post_forward=self.gather.release,
                                pre_backward=self._pre_backward,
                                post_backward=self._post_backward)

    # initialisation, one layer at a time
    def _pre_reset(self, unit) -> None:
        self._init_buf = self.xp.zeros(unit.numel, dtype=self.dtype)
        unit.bind_params(self._init_buf)

    def _post_reset(self, unit) -> None:
        start, mine = self.shards.mine(unit.lo, unit.hi)
        self.pshard[start - self.offset:start - self.offset + mine] = \
            self._init_buf[start - unit.lo:start - unit.lo + mine]
        unit.bind_params(None)
        self._init_buf = None

    # hooks around each layer
    def _pre_forward(self, unit) -> None:
        self._recording.append(unit)
        self.gather.acquire(unit)

    def _pre_backward(self, unit) -> None:
        self.gather.acquire(unit)
        self.grads.pre_backward(unit)

    def _post_backward(self, unit) -> None:
        self.grads.post_backward(unit)
        self.gather.release(unit)

    # the step's phases
    def _begin_forward(self) -> None:
        self._recording = []
        self.gather.begin(self.forward_order)

    def _end_forward(self) -> None:
        self.gather.end_phase()
        self.forward_order = self._recording
        self.gather.begin(reversed(self._recording))

    def _begin_step(self) -> None:
        self.grads.begin()

    def _end_backward(self) -> None:
        self.grads.finish()
        self.gather.end_phase()

    def _publish_params(self) -> None:
        """Nothing to publish: the next forward gathers from the updated shards."""

    def param_shard(self):
        return self.pshard

    def grad_shard(self):
        return self.grads.grad_shard

    def _compressed_buffers(self) -> list[tuple[int, int]]:
        return self.grads.ranges

    def _held(self):
        return [self.pshard], self.grads.held
