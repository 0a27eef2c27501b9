"""The part of a ZeRO step every stage shares; the stages differ in what a rank keeps whole.

    ZeroEngine.train_step(x, y):
      1. forward and backward         (per micro-batch; stage 3: each layer's parameters
                                       gathered around it)
      2. gradients onto their owners  (stage 1: one reduce-scatter after the last backward;
                                       stages 2, 3: bucket by bucket during each backward)
      3. optimizer on my shard        (fp32 masters; LARS/LAMB norms summed over shards;
                                       NaN/Inf on any rank skips the step on all)
      4. parameters back to all       (stages 1, 2: allgather; stage 3: on demand)
Shards are chunk() of the flat layout (Layout.shard). Gradients are SUMMED with the loss
normalised by the global batch, so a step equals the data-parallel step. A 1-bit optimizer
past its warm-up sends its local momentum in step 2 instead (mpidist.strategy.onebit).
"""
from __future__ import annotations

import abc
import time

import ml_dtypes
import numpy as np
from mpi4py import MPI

from mpidist.collectives import allgather, allreduce
from mpidist.comm import as_communicator
from mpidist.flat import Layout
from mpidist.kernels.backend import get_array_module
from mpidist.nn.loss import SoftmaxCrossEntropy
from mpidist.partition import chunk
from mpidist.state import StateDict, flat_pieces, read_flat, read_params
from mpidist.strategy.compression_state import compression_pieces, compression_scalars, restore_compression
from mpidist.strategy.onebit import OnebitDriver, is_onebit
from mpidist.zero.exchange import ShardMap
from mpidist.zero.memory import InFlight, MemoryReport, nbytes
from mpidist.zero.units import find_units, placeholder

__all__ = ["ZeroEngine", "PARAM_DTYPES", "check_stage"]

PARAM_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def check_stage(stage) -> int:
    """The ZeRO stage as an int in 1..3, or a ValueError saying what is allowed."""
    if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)) or \
            stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r} (1: shard optimizer "
                         f"states, 2: and gradients, 3: and parameters)")
    return int(stage)


def param_dtype(dtype) -> np.dtype:
    """float32, float16 or bfloat16 (names accepted), else a ValueError listing them."""
    names = {"float32": np.float32, "fp32": np.float32, "float16": np.float16,
             "fp16": np.float16, "bfloat16": ml_dtypes.bfloat16, "bf16": ml_dtypes.bfloat16}
    try:
        dt = np.dtype(names.get(dtype, dtype) if isinstance(dtype, str) else dtype)
    except TypeError:
        dt = None
    if dt not in PARAM_DTYPES:
        raise ValueError(f"parameter dtype must be float32, float16 or bfloat16, got {dtype!r}")
    return dt


class ZeroEngine(abc.ABC):
    """Model + optimizer, partitioned over a data-parallel communicator (base of the stages).

    model: an mpidist.nn Module (unbound: the engine lays out and binds its parameters);
    make_optimizer(layout, offset, count, param_dtype) -> an mpidist optimizer over that range;
    dtype: parameter and gradient dtype (fp16/bf16: the optimizer keeps fp32 masters);
    seed: initial parameters, identical to model.init_params(np.random.default_rng(seed));
    bucket_mb: gradient bucket size (stages 2, 3; 0 = one bucket, reduced after backward);
    max_in_flight: gradient buckets in flight before the oldest is waited for;
    accumulation: micro-batches per step (this rank's rows split by chunk(), as the
    data-parallel strategy splits them; stages 2, 3 reduce each micro-batch's buckets);
    compression: a mpidist.compress.CompressedAllreduce over comm (error feedback in it).
    Stage 1: the gradients are summed by its allreduce instead of the reduce-scatter, and
    each rank keeps its shard of the sum; stages 2 and 3: each bucket goes through its
    compressed reduce-scatter (every piece compressed for its owner, payloads by
    alltoallv, summed in rank order), once per micro-batch.
    Construction is collective over comm.
    """
    stage = 0

    def __init__(self, model, make_optimizer, *, comm=None, dtype=np.float32, seed: int = 0,
                 bucket_mb: float = 4.0, max_in_flight: int = 2, accumulation: int = 1,
                 xp=np, compression=None):
        self.comm = as_communicator(comm)
        error = None
        try:
            self.dtype = param_dtype(dtype)
            if not callable(make_optimizer):
                raise TypeError("make_optimizer must be a callable(layout, offset, count, "
                                "param_dtype) -> optimizer")
            if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or \
                    bucket_mb < 0:
                raise ValueError(f"bucket_mb must be a number >= 0, got {bucket_mb!r}")
            for what, v in (("max_in_flight", max_in_flight), ("accumulation", accumulation)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"{what} must be an integer >= 1, got {v!r}")
            if compression is not None and not hasattr(compression, "allreduce_async"):
                raise TypeError(f"compression must be a mpidist.compress.CompressedAllreduce, got "
                                f"{type(compression).__name__}")
            self.layout = Layout(model.param_shapes())
            self.units = find_units(model, self.layout)
        except (TypeError, ValueError) as exc:
            error = exc
        self.comm.raise_if_any(error)
        self.comm.check_same([(s.name, s.shape) for s in self.layout], "model parameter layout")
        self.model, self.xp = model, xp
        self.bucket_elems = (self.layout.numel if bucket_mb == 0 else
                             max(1, int(bucket_mb * (1 << 20)) // self.dtype.itemsize))
        self.max_in_flight, self.accumulation = max_in_flight, accumulation
        self.compression = compression
        self.shards = ShardMap(self.comm, self.layout.numel)
        self.offset, self.count = self.shards.offset, self.shards.count
        self.inflight = InFlight()
        self.loss = SoftmaxCrossEntropy()
        self.step = 0
        self.t_comm = 0.0          # seconds waiting for communication in this step
        self._setup(np.random.default_rng(seed))
        self.optimizer = make_optimizer(self.layout, self.offset, self.count, self.dtype)
        self.onebit = self._make_onebit()

    def _make_onebit(self):
        """The momentum exchange of a 1-bit optimizer (None for others); collective."""
        if not is_onebit(self.optimizer):
            return None
        error = None
        if self.compression is not None:
            error = ValueError(f"optimizer {self.optimizer.name!r} compresses its momentum "
                               f"itself; remove the gradient compression")
        elif self.stage > 1 and self.accumulation > 1:
            error = ValueError(f"optimizer {self.optimizer.name!r} at ZeRO stage {self.stage} "
                               f"needs accumulation = 1 (each micro-batch's buckets go out, "
                               f"the local momentum needs the whole step's gradient)")
        self.comm.raise_if_any(error)
        # my range is a shard: 1-bit LAMB's per-tensor maximum is taken over all of them
        self.optimizer.reduce_max = self._reduce_max
        return OnebitDriver(self.optimizer, self.layout, self.comm, mult=self.comm.size,
                            xp=self.xp)

    def _reduce_max(self, values):
        out = np.ascontiguousarray(values, dtype=np.float64)
        self.comm.comm.Allreduce(MPI.IN_PLACE, out, op=MPI.MAX)
        return out

    @property
    def sends_momentum(self) -> bool:
        """True while a 1-bit optimizer's compression stage replaces the gradient exchange."""
        return self.onebit is not None and self.onebit.frozen

    # ------------------------------------------------------------------ per stage
    @abc.abstractmethod
    def _setup(self, rng) -> None:
        """Allocate and initialise parameters/gradients and bind the model."""

    @abc.abstractmethod
    def _begin_step(self) -> None:
        """Before the first micro-batch: zero what backward accumulates into."""

    def _end_backward(self) -> None:
        """After each micro-batch's backward (stages 2, 3: its buckets reduced into the shard)."""

    def _finish_grads(self) -> None:
        """After the last micro-batch (stage 1: the reduce-scatter); then my shard of the
        summed gradients is in self.grad_shard()."""

    def _compressed_buffers(self) -> list[tuple[int, int]]:
        """(offset, count) of each buffer the compression keeps state for (stage 1: the whole
        gradient; stages 2, 3: the buckets)."""
        return [(0, self.layout.numel)]

    @abc.abstractmethod
    def _publish_params(self) -> None:
        """After the optimizer step: make the new parameters visible where forward needs them."""

    @abc.abstractmethod
    def param_shard(self):
        """My shard of the parameters, [offset, offset+count), 1-D (live)."""

    @abc.abstractmethod
    def grad_shard(self):
        """My shard of the summed gradients (valid after backward), 1-D (live)."""

    @abc.abstractmethod
    def _held(self) -> tuple[list, list]:
        """(parameter arrays, gradient arrays) this rank keeps between steps."""

    # ------------------------------------------------------------------ the step
    def _placeholders(self, dtype) -> dict:
        return {s.name: placeholder(self.xp, dtype, s.shape) for s in self.layout}

    def _reduce_norms(self, partials):
        """Per-segment partial sums of squares -> summed over the shards (LARS/LAMB)."""
        return allreduce(np.ascontiguousarray(partials), op="sum", comm=self.comm)

    def forward_backward(self, x, y, global_count: int):
        """Steps 1-2 only: forward, loss, backward of each micro-batch of my rows (gradients
        summed over them); then the summed gradient shard is ready."""
        self._begin_step()
        loss_sum = correct = 0.0
        for i in range(self.accumulation):
            lo, n = chunk(len(y), i, self.accumulation)
            self._begin_forward()
            logits = self.model.forward(x[lo:lo + n], train=True)
            self._end_forward()
            l, c = self.loss.forward(logits, y[lo:lo + n])
            self.model.backward(self.loss.backward(1.0 / global_count))
            self._end_backward()
            loss_sum, correct = loss_sum + l, correct + c
        self._finish_grads()
        return loss_sum, correct

    def train_step(self, x, y, global_count: int | None = None) -> dict:
        """One step on this rank's rows; returns loss (global mean), correct, count, timings.

        global_count: targets in the whole global batch (the loss is their mean); default:
        summed over the ranks."""
        count = int(np.asarray(y).size)
        if global_count is None:
            global_count = self.comm.comm.allreduce(count)
        self.inflight.reset_peak()
        self.t_comm = 0.0
        t0 = time.perf_counter()
        momentum = self.sends_momentum
        if momentum:
            self.onebit.begin()
        loss_sum, correct = self.forward_backward(x, y, global_count)
        if momentum and self.stage == 1:      # 2. the whole local gradient, as momentum
            t = time.perf_counter()
            self.onebit.send(self.grads.data.astype(np.float32, copy=self.dtype != np.float32))
            self.t_comm += time.perf_counter() - t
        t1, comm_in_backward = time.perf_counter(), self.t_comm
        # NaN/Inf in any rank's shard skips the step everywhere; the loss sums ride along
        g = self.onebit.summed if momentum else self.grad_shard()
        bad = 0.0 if bool(get_array_module(g).isfinite(g).all()) else 1.0
        totals = np.array([bad, loss_sum, correct, count], np.float64)
        self.comm.comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
        if momentum:
            self.info = self.onebit.finish(self.param_shard(), reduce_norms=self._reduce_norms,
                                           finite=bool(totals[0] == 0))
        else:
            self.info = self.optimizer.step(self.param_shard(), g, reduce_norms=self._reduce_norms,
                                            finite=bool(totals[0] == 0))
        t2 = time.perf_counter()
        self._publish_params()
        t3 = time.perf_counter()
        self.step += 1
        return {"loss": float(totals[1] / max(1.0, totals[3])), "correct": int(totals[2]),
                "count": int(totals[3]), "t_compute": t1 - t0 - comm_in_backward,
                "t_comm": comm_in_backward + (t3 - t2), "t_optim": t2 - t1,
                "skipped": bool(self.info.skipped)}

    def timed_wait(self, pending):
        """pending.wait(), its time counted in this step's communication (t_comm)."""
        t = time.perf_counter()
        out = pending.wait()
        self.t_comm += time.perf_counter() - t
        return out

    def evaluate(self, x, y) -> dict:
        """Loss summed, correct and count over every rank's rows (same on all ranks)."""
        self._begin_forward()
        logits = self.model.forward(x, train=False)
        self._end_forward()
        loss_sum, correct = self.loss.forward(logits, y)
        totals = self.comm.comm.allreduce(np.array([loss_sum, correct, np.asarray(y).size],
                                                   np.float64))
        return {"loss": float(totals[0]), "correct": int(totals[1]), "count": int(totals[2])}

    def _begin_forward(self) -> None:
        """Before a forward (stage 3: plan the gathers)."""

    def _end_forward(self) -> None:
        """After a forward (stage 3: release what it gathered, plan backward's gathers)."""

    # ------------------------------------------------------------------ views for tests/tools
    def full_params(self):
        """Collective: the whole flat parameter vector on every rank (small models, tests)."""
        return allgather(self.param_shard().copy(), comm=self.comm,
                         out=self.xp.empty(self.layout.numel, self.dtype))

    # ------------------------------------------------------------------ memory
    def memory_report(self) -> MemoryReport:
        """What this rank holds now, from the .nbytes of its buffers."""
        params, grads = self._held()
        states = self.optimizer.state_buffers()
        # the optimizer's fp32 copy of half-precision gradients (allocated at its first step)
        scratch = getattr(self.optimizer, "_gscratch", None)
        return MemoryReport(stage=self.stage, rank=self.comm.rank, size=self.comm.size,
                            numel=self.layout.numel, shard=self.count,
                            params=nbytes(*params), grads=nbytes(*grads),
                            optim=nbytes(*states.values()), workspace=nbytes(scratch),
                            in_flight=self.inflight.current,
                            peak_in_flight=self.inflight.peak)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> StateDict:
        """My pieces of the global tensors: params/<name>, optim/<state>/<name>."""
        tensors = flat_pieces("params", self.layout, self.param_shard(), self.offset)
        for state, buf in self.optimizer.state_buffers().items():
            tensors.update(flat_pieces(f"optim/{state}", self.layout, buf, self.offset))
        scalars = {"optim_step": self.optimizer.step_count, "zero_stage": self.stage,
                   "param_dtype": str(self.dtype), "optim_extra": self.optimizer.extra_state()}
        if self.compression is not None:      # this rank's residuals, one row per rank
            tensors.update(compression_pieces(self.compression, self.layout, self.comm.rank, self.comm.size))
            scalars["compression"] = compression_scalars(self.compression)
        if self.onebit is not None:           # the 1-bit momentum exchange's residuals
            tensors.update(self.onebit.pieces(self.comm.rank, self.comm.size))
            scalars.update(self.onebit.scalars())
        return StateDict(self.step, tensors, scalars)

    def load_state_dict(self, source) -> None:
        """Collective: read my shard of every tensor from source (any writer world size)."""
        error = None
        try:
            read_params(source, self.layout, self.param_shard(), self.offset)
            sd = self.optimizer.state_dict()
            state = {}
            for name, buf in sd["state"].items():
                if name == "master":      # the writer's fp32 masters, or its fp32 parameters
                    read_params(source, self.layout, buf, self.offset)
                else:
                    read_flat(source, f"optim/{name}", self.layout, buf, self.offset)
                state[name] = buf
            sd["step"] = int(source.scalars.get("optim_step", source.step))
            sd["state"] = state
            sd["extra"] = source.scalars.get("optim_extra", sd["extra"])
            self.optimizer.load_state_dict(sd)
            if self.compression is not None:
                restore_compression(self.compression, source, self.layout, self._compressed_buffers(),
                                    self.comm.rank, self.comm.size)
            if self.onebit is not None:
                self.onebit.restore(source, self._compressed_buffers(), self.comm.rank,
                                    self.comm.size)
            self.step = int(source.step)
        except (KeyError, TypeError, ValueError) as exc:
            error = exc
        self.comm.raise_if_any(error)
        self._publish_params()
