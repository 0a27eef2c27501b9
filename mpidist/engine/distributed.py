"""DistributedOptimizer: data-parallel gradient averaging around any mpidist optimizer.

The Horovod-style entry point. Gradients live in one flat buffer cut into buckets of about
`bucket_mb` MiB at tensor boundaries, numbered from the END (backward produces the last
layer's gradients first). As the model reports gradients ready, every complete bucket is
launched with allreduce_async, in bucket order on every rank, so communication overlaps
backward. step() then:
    1. launches the buckets not yet launched and waits for all of them (in order),
    2. agrees across ranks whether any gradient is NaN/Inf (one small allreduce, which also
       carries the caller's metrics), and skips the update everywhere if so,
    3. runs the wrapped optimizer on the averaged gradients and zeroes them.
With accumulation=k the first k-1 step() calls only count micro-steps. Codes that keep
parameters in plain arrays use `for_arrays`. See docs/ARCHITECTURE.md ("Engine").
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from mpidist.collectives import allreduce_async
from mpidist.comm import as_communicator
from mpidist.compress import CompressedAllreduce, make_compressor
from mpidist.flat import FlatBuffer, Layout
from mpidist.kernels.backend import get_array_module
from mpidist.strategy.onebit import OnebitDriver, is_onebit

__all__ = ["DistributedOptimizer", "make_buckets"]


TAPER = 4      # the ends of backward get buckets of bucket_mb / TAPER


def make_buckets(layout: Layout, itemsize: int, bucket_mb: float) -> list[tuple[int, int]]:
    """[(lo, hi)] flat ranges, whole tensors each, from the end of the buffer to its start.

    A bucket closes once it holds at least bucket_mb MiB; bucket_mb = 0 gives one bucket.
    Both ends of backward take smaller buckets, of bucket_mb / TAPER: the first one (the
    last layers), so that the first transfer starts early, and those within bucket_mb of
    the buffer's start (what backward finishes last), so that what is left to send once
    backward has ended, the step's exposed tail, is one small bucket rather than a full one.
    """
    full = bucket_mb * 2 ** 20 if bucket_mb > 0 else float("inf")
    buckets, hi, nbytes = [], layout.numel, 0
    for seg in reversed(layout.segments):
        nbytes += seg.size * itemsize
        tapered = not buckets or seg.offset * itemsize < full
        if nbytes >= (full / TAPER if tapered else full):
            buckets.append((seg.offset, hi))
            hi, nbytes = seg.offset, 0
    if hi > 0 or not buckets:
        buckets.append((0, hi))
    return buckets


class DistributedOptimizer:
    """Average gradients over comm, bucketed and overlapped with backward, then step optimizer.

    optimizer: an mpidist.optim optimizer over the whole layout, or a callable layout -> one.
    params, grads: FlatBuffers of one layout (e.g. from mpidist.nn.materialize).
    algorithm: the mpidist.collectives allreduce algorithm ("ring", "tree", ..., "auto").
    op: "avg" divides the summed gradients by size * accumulation (Horovod semantics: each rank
      passes the mean over its own batch); "sum" leaves them summed (the caller normalised).
    compression: None; a compressor (mpidist.compress.make_compressor(name, **options), or
      its name), summed by a CompressedAllreduce with its defaults; or a CompressedAllreduce
      over the ranks of comm, to set its warm-up steps and how payloads combine (give it
      nonfinite="skip" to have an inf/NaN step skipped rather than raise).
    broadcast: start from rank 0's parameters and optimizer state (collective, at construction).
    """

    def __init__(self, optimizer, params: FlatBuffer, grads: FlatBuffer, *, comm=None, algorithm: str = "auto",
                 bucket_mb: float = 4.0, accumulation: int = 1, op: str = "avg", compression=None,
                 broadcast: bool = True):
        if not isinstance(params, FlatBuffer) or not isinstance(grads, FlatBuffer):
            raise TypeError("params and grads must be mpidist.flat.FlatBuffer (see mpidist.nn.materialize), "
                            "or use DistributedOptimizer.for_arrays for plain arrays")
        if params.layout != grads.layout or params.dtype != grads.dtype:
            raise ValueError("params and grads must share one layout and dtype")
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        if int(accumulation) < 1:
            raise ValueError(f"accumulation must be >= 1, got {accumulation!r}")
        if bucket_mb < 0:
            raise ValueError(f"bucket_mb must be >= 0, got {bucket_mb!r}")
        self.comm = as_communicator(comm)
        self.layout = params.layout
        self.params, self.grads = params, grads
        self.optimizer = optimizer(self.layout) if callable(optimizer) and not hasattr(optimizer, "step") else optimizer
        if not hasattr(self.optimizer, "step"):
            raise TypeError(f"optimizer must be an mpidist optimizer (with step), got {type(optimizer).__name__}")
        self.algorithm, self.op = algorithm, op
        self.accumulation = int(accumulation)
        self.compressed = self._make_compressed(compression)   # a CompressedAllreduce or None
        ca = self.compressed
        self.comm.check_same((self.layout.numel, str(params.dtype), algorithm, op, self.accumulation,
                              float(bucket_mb), None if ca is None else
                              (ca.compressor.config(), ca.algorithm, ca.warmup_steps, ca.nonfinite)),
                             "DistributedOptimizer settings (numel, dtype, algorithm, op, accumulation, "
                             "bucket_mb, compression)")
        self.onebit = self._make_onebit()
        self.buckets = make_buckets(self.layout, params.dtype.itemsize, bucket_mb)
        bucket_of = np.empty(len(self.layout), dtype=np.int64)
        for b, (lo, hi) in enumerate(self.buckets):
            for index, _, _ in self.layout.clip(lo, hi):
                bucket_of[index] = b
        self._bucket_of = {seg.name: int(bucket_of[seg.index]) for seg in self.layout.segments}
        self._size_of = np.bincount(bucket_of, minlength=len(self.buckets))
        self._views = [grads.data[lo:hi] for lo, hi in self.buckets]
        self._micro = 0
        self._reset_round()
        self.t_launch = self.t_wait = 0.0
        self._user_arrays = None
        if broadcast:
            self.broadcast_state(root=0)

    def _make_compressed(self, compression) -> CompressedAllreduce | None:
        """The compression argument as a CompressedAllreduce over comm (None: no compression).
        A compressor alone gets nonfinite="skip": a NaN/Inf bucket comes back NaN (residuals
        untouched), so step 2's agreement skips the update."""
        if compression is None or compression == "none":
            return None
        if not isinstance(compression, CompressedAllreduce):
            return CompressedAllreduce(make_compressor(compression), self.comm, nonfinite="skip")
        error = None
        if (compression.comm.rank, compression.comm.size) != (self.comm.rank, self.comm.size):
            error = ValueError(f"the CompressedAllreduce runs on rank {compression.comm.rank} of "
                               f"{compression.comm.size}, the optimizer on rank {self.comm.rank} "
                               f"of {self.comm.size}: build it over the same communicator")
        self.comm.raise_if_any(error)
        return compression

    def allreduce_async(self, buf):
        """Launch the sum of one gradient bucket over comm (compressed, where configured); the
        layout lets PowerSGD see each bucket's matrices."""
        if self.compressed is not None:
            return self.compressed.allreduce_async(buf, op="sum", layout=self.layout)
        return allreduce_async(buf, op="sum", algorithm=self.algorithm, comm=self.comm)

    def _make_onebit(self):
        """A 1-bit optimizer (mpidist.optim.onebit) sends its own compressed momentum once
        its warm-up is over: the driver of that exchange (strategy.onebit), else None."""
        if not is_onebit(self.optimizer):
            return None
        if self.compressed is not None:
            raise ValueError(f"optimizer {self.optimizer.name!r} compresses its momentum itself "
                             f"(its compressor option); remove the gradient compression")
        # op="sum": each rank's gradient is its share of the sum; "avg": of the mean
        mult = self.comm.size if self.op == "sum" else 1.0 / self.accumulation
        return OnebitDriver(self.optimizer, self.layout, self.comm, mult=mult, xp=self.grads.xp)

    # ------------------------------------------------------------------ plain arrays
    @classmethod
    def for_arrays(cls, arrays, optimizer, *, names=None, **kwargs) -> "DistributedOptimizer":
        """Wrap a list of plain parameter arrays (an existing code's own tensors).

        optimizer: callable layout -> mpidist optimizer, e.g.
          lambda layout: mpidist.optim.build_optimizer("lamb", layout, lr=1e-2).
        Call step(grads) with the gradient arrays in the same order; the arrays passed here
        are updated in place (and overwritten by rank 0's at construction when broadcast).
        """
        arrays = list(arrays)
        if not arrays:
            raise ValueError("for_arrays needs at least one parameter array")
        xp = get_array_module(*arrays)
        if any(get_array_module(a) is not xp for a in arrays) or len({a.dtype for a in arrays}) != 1:
            raise TypeError("all parameter arrays must share one array module and one dtype")
        names = names or [f"p{i}" for i in range(len(arrays))]
        params = FlatBuffer.pack(list(zip(names, arrays)))
        grads = params.zeros_like()
        self = cls(optimizer, params, grads, **kwargs)
        self._user_arrays = arrays
        self._copy_out()
        return self

    def _copy_out(self) -> None:
        for a, name in zip(self._user_arrays, self.layout.names):
            a[...] = self.params.view(name)

    # ------------------------------------------------------------------ broadcast
    def broadcast_state(self, root: int = 0) -> None:
        """Collective: overwrite parameters and optimizer state with root's."""
        bufs = [self.params.data] + [b for _, b in sorted(self.optimizer.state_buffers().items())]
        for b in bufs:
            m = self.comm.to_mpi(b)
            self.comm.comm.Bcast(m, root=root)
            self.comm.from_mpi(m, b)
        if self._user_arrays is not None:
            self._copy_out()

    # ------------------------------------------------------------------ backward hooks
    def attach(self, model) -> None:
        """Have model report gradients ready, so buckets start during its backward."""
        model.set_grad_hook(self.grad_ready)

    def _reset_round(self) -> None:
        self._pending = self._size_of.copy()
        self._reported: set = set()
        self._handles: list = []

    @property
    def in_flight(self) -> int:
        """Buckets launched and not yet waited for."""
        return len(self._handles)

    @property
    def last_micro_step(self) -> bool:
        """True while the backward now running finishes an optimizer step (buckets go out)."""
        return self._micro == self.accumulation - 1

    def grad_ready(self, names) -> None:
        """Called by the model's grad hook; launches every bucket that became complete."""
        if not self.last_micro_step:
            return
        for name in names:
            if name not in self._reported:
                self._reported.add(name)
                self._pending[self._bucket_of[name]] -= 1
        self._launch(all_buckets=False)

    def _launch(self, all_buckets: bool) -> None:
        if self.comm.size == 1 and self.compressed is None:   # a plain sum over one rank: no-op
            return
        if self.onebit is not None and self.onebit.frozen:    # the momentum goes instead
            return
        t0 = time.perf_counter()
        while len(self._handles) < len(self.buckets):
            b = len(self._handles)
            if not all_buckets and self._pending[b] > 0:
                break
            self._handles.append(self.allreduce_async(self._views[b]))
        self.t_launch += time.perf_counter() - t0

    # ------------------------------------------------------------------ the step
    def step(self, grads=None, stats=None) -> dict:
        """Finish one micro-step; on the last one, average, agree on finiteness and update.

        grads: for for_arrays only, the gradient arrays of this micro-step (added in).
        stats: optional small float vector summed across ranks in the same message as the
        finiteness flag; returned as info["stats"].
        Returns {"applied": bool, "skipped": bool (non-finite gradients), "stats", optimizer info,
        and this step's seconds: t_launch (bucket launches during backward), t_wait (waiting for
        the reductions and the agreement), t_optim (update and zeroing)}.
        """
        if self._user_arrays is not None:
            if grads is None or len(grads) != len(self._user_arrays):
                raise ValueError(f"step() needs the {len(self._user_arrays)} gradient arrays of for_arrays")
            for g, name in zip(grads, self.layout.names):
                self.grads.view(name)[...] += g
        elif grads is not None:
            raise ValueError("step(grads) is for for_arrays; model gradients are already in the grad buffer")
        if not self.last_micro_step:
            self._micro += 1
            return {"applied": False, "skipped": False}

        # 1. every bucket launched and reduced, in bucket order
        self._launch(all_buckets=True)
        t0 = time.perf_counter()
        for view, h in zip(self._views, self._handles):
            out = h.wait()
            if out is not None and out is not view:
                view[...] = out
        xp = self.grads.xp
        local = self.onebit is not None and self.onebit.frozen     # gradients stay local
        if self.op == "avg" and not local:
            self.grads.data *= 1.0 / (self.comm.size * self.accumulation)

        # 2. NaN/Inf agreed across ranks, with the caller's stats in the same message
        # one pass: a NaN/Inf anywhere makes the sum non-finite (a finite buffer whose float32
        # sum overflows is also skipped: such a step would be useless anyway)
        bad = 0.0 if bool(xp.isfinite(self.grads.data.sum())) else 1.0
        vec = np.concatenate([[bad], np.asarray(stats if stats is not None else [], dtype=np.float64)])
        self.comm.comm.Allreduce(MPI.IN_PLACE, vec, op=MPI.SUM)
        self.t_wait += time.perf_counter() - t0
        info = {"applied": True, "skipped": bool(vec[0] > 0), "stats": vec[1:]}

        # 3. the update, then a clean gradient buffer for the next step
        t0 = time.perf_counter()
        if not info["skipped"]:
            if local:       # 1-bit optimizers: the compressed momentum exchange and update
                out = self.onebit.step(self.params.data, self.grads.data, finite=True)
            else:
                out = self.optimizer.step(self.params.data, self.grads.data, finite=True)
            info.update(lr=out.lr, optim_step=out.step)
            if self._user_arrays is not None:
                self._copy_out()
        self.grads.data[...] = 0
        info.update(t_launch=self.t_launch, t_wait=self.t_wait, t_optim=time.perf_counter() - t0)
        self.t_launch = self.t_wait = 0.0
        self._micro = 0
        self._reset_round()
        return info

    def zero_grad(self) -> None:
        """Drop accumulated gradients and micro-steps (e.g. after an exception mid-step)."""
        self.grads.data[...] = 0
        self._micro = 0
        self._reset_round()
