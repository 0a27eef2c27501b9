"""ZeRO stage 2 (P_os+g): optimizer states and gradients partitioned; parameters whole.

    1. forward on the whole parameters
    2. backward: each layer's gradients go to a bucket buffer; when a bucket is complete it
       is reduce-scattered onto its owners at once (nonblocking, overlapping the backward of
       the layers before it) and freed when done, so a rank holds its gradient shard plus
       at most `max_in_flight` buckets (with compression: the bucket's compressed
       reduce-scatter, mpidist.compress.reduce_scatter, before backward goes on)
    3. the optimizer updates my shard
    4. allgather of the updated shards into the whole parameter buffer

Communication: as data parallel. Memory per parameter: 2 + 14/N bytes with mixed-precision
Adam, plus the buckets in flight.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from mpidist.collectives import Handle, allgather
from mpidist.flat import FlatBuffer
from mpidist.zero.engine import ZeroEngine
from mpidist.zero.exchange import reduce_scatter_start
from mpidist.zero.units import LayerHooks

__all__ = ["Stage2", "GradBuckets"]


@dataclass(eq=False)
class _Bucket:
    index: int
    lo: int
    hi: int
    units: list
    buf: object = None
    remaining: int = 0
    launched: bool = False
    pending: object = field(default=None, repr=False)


class GradBuckets:
    """Gradients of stages 2 and 3: bucket buffers in flight, reduce-scattered and added into
    a shard (so micro-batches accumulate there).

    Buckets are runs of consecutive layers, planned from the end of the layout (backward
    produces gradients from the last layer to the first) so each holds >= bucket_elems
    elements (the first may hold fewer). A layer whose backward runs twice in one step
    (a shared layer) is reported rather than silently summed twice over the wire.
    """

    def __init__(self, engine, grad_shard):
        self.e = engine
        self.grad_shard = grad_shard
        self.buckets: list[_Bucket] = []
        run, size = [], 0
        for unit in reversed(engine.units):
            run.append(unit)
            size += unit.numel
            if size >= engine.bucket_elems:
                self._close(run)
                run, size = [], 0
        if run:
            self._close(run)
        self.buckets.reverse()
        for i, b in enumerate(self.buckets):
            b.index = i
        self.bucket_of = {u.index: b for b in self.buckets for u in b.units}
        self.queue: deque = deque()

    def _close(self, run) -> None:
        units = sorted(run, key=lambda u: u.lo)
        self.buckets.append(_Bucket(0, units[0].lo, units[-1].hi, units))

    def begin(self) -> None:
        """Before a step: a zero shard, every bucket empty (also after a failed step)."""
        while self.queue:
            self._retire()
        for b in self.buckets:
            if b.buf is not None:
                self._free(b)
            b.remaining, b.launched = len(b.units), False
        self.grad_shard[...] = 0

    def pre_backward(self, unit) -> None:
        b = self.bucket_of[unit.index]
        if b.launched:
            raise RuntimeError(f"layer {unit.names[0].rsplit('.', 1)[0]} ran backward twice in "
                               f"one step; ZeRO stages 2 and 3 need each layer used once "
                               f"(use stage 1 for models with shared layers)")
        if b.buf is None:
            b.buf = self.e.inflight.add(self.e.xp.zeros(b.hi - b.lo, dtype=self.e.dtype))
            for u in b.units:
                u.bind_grads(b.buf[u.lo - b.lo:u.hi - b.lo])

    def post_backward(self, unit) -> None:
        b = self.bucket_of[unit.index]
        b.remaining -= 1
        if b.remaining == 0:
            self._launch(b)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """(offset, count) of every bucket in the flat layout."""
        return [(b.lo, b.hi - b.lo) for b in self.buckets]

    def _launch(self, b: _Bucket) -> None:
        start, mine = self.e.shards.mine(b.lo, b.hi)
        out = self.grad_shard[start - self.e.offset:start - self.e.offset + mine]
        if self.e.sends_momentum:
            b.pending = self._momentum(b)
        elif self.e.compression is None:
            b.pending = reduce_scatter_start(self.e.comm, self.e.shards, b.buf, b.lo, out=out)
        else:
            b.pending = self._compressed(b, out)
        self.e.inflight.add(*b.pending.buffers)
        b.launched = True
        self.queue.append(b)
        while len(self.queue) > self.e.max_in_flight:
            self._retire()

    def _compressed(self, b: _Bucket, out) -> Handle:
        """The bucket's compressed reduce-scatter (blocking: a compressor does not overlap);
        my piece is added into out. Half-precision gradients are compressed from float32."""
        t = time.perf_counter()
        g = b.buf if b.buf.dtype == np.float32 else b.buf.astype(np.float32)
        out[...] += self.e.compression.reduce_scatter(g, lo=b.lo, n=self.e.layout.numel)
        self.e.t_comm += time.perf_counter() - t
        return Handle(out)

    def _momentum(self, b: _Bucket) -> Handle:
        """A 1-bit optimizer's compression stage: the bucket as local momentum through the
        momentum's compressed reduce-scatter, summed into the exchange's own float32 shard
        (blocking); the gradient shard stays zero."""
        t = time.perf_counter()
        self.e.onebit.send(b.buf.astype(np.float32, copy=True), lo=b.lo)
        self.e.t_comm += time.perf_counter() - t
        return Handle(None)

    def _retire(self) -> None:
        b = self.queue.popleft()
        self.e.timed_wait(b.pending)
        self.e.inflight.drop(*b.pending.buffers)
        self._free(b)

    def _free(self, b: _Bucket) -> None:
        for u in b.units:
            u.bind_grads(None)
        self.e.inflight.drop(b.buf)
        b.buf, b.pending = None, None

    def finish(self) -> None:
        """After a backward: launch buckets whose layers did not all run, wait for all, and
        make every bucket ready for the next micro-batch's backward."""
        for b in self.buckets:
            if b.buf is not None and not b.launched:
                self._launch(b)
        while self.queue:
            self._retire()
        for b in self.buckets:
            b.remaining, b.launched = len(b.units), False

    @property
    def held(self) -> list:
        return [self.grad_shard]


class Stage2(ZeroEngine):
    """ZeRO stage 2: optimizer states and gradients sharded (gradient buckets reduce-scattered)."""
    stage = 2

    def _setup(self, rng) -> None:
        self.params = FlatBuffer(self.layout, dtype=self.dtype, xp=self.xp)
        self.model.bind(self.params.views(), self._placeholders(self.dtype))
        self.model.init_params(rng)
        self.grads = GradBuckets(self, self.xp.zeros(self.count, dtype=self.dtype))
        self.hooks = LayerHooks(self.units, pre_backward=self.grads.pre_backward,
                                post_backward=self.grads.post_backward)

    def param_shard(self):
        return self.params.data[self.offset:self.offset + self.count]

    def _compressed_buffers(self) -> list[tuple[int, int]]:
        return self.grads.ranges

    def grad_shard(self):
        return self.grads.grad_shard

    def _held(self):
        return [self.params.data], self.grads.held

    def _begin_step(self) -> None:
        self.grads.begin()

    def _end_backward(self) -> None:
        self.grads.finish()

    def _publish_params(self) -> None:
        # 4. allgather the updated shards in place (the ring allgather leaves my chunk alone)
        allgather(self.param_shard(), comm=self.comm, out=self.params.data, algorithm="ring")
