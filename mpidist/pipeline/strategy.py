"""[parallel] strategy = "pipeline": pipeline stages x data-parallel replicas.

Ranks form the pp x dp grid of Communicator.grid(pp). The pp ranks of a replica run the
schedule on that replica's rows of the global batch; then, in each stage's dp group:
    1. the stage's gradients are summed across its replicas (allreduce; with compression
       the CompressedAllreduce, given the stage's layout so PowerSGD sees its matrices)
    2. the optimizer updates the stage's parameters (zero = 1: ZeRO stage 1 in the dp
       group: reduce-scatter, the optimizer on my shard, allgather of the shards)
so one step equals a single-rank step on the same model and global batch. A 1-bit
optimizer past its warm-up replaces 1 by its momentum exchange (mpidist.strategy.onebit).
Bad input fails on every rank before training: stages not dividing the world size, more
(virtual) stages than layers, micro-batches not dividing each replica's rows.
"""
from __future__ import annotations

import copy
import logging
import os
import time

import numpy as np
from mpi4py import MPI

from mpidist.collectives import allgather, allreduce, reduce_scatter
from mpidist.errors import ConfigError
from mpidist.nn import SoftmaxCrossEntropy, materialize
from mpidist.pipeline.cuts import measure_layer_costs, stage_bounds
from mpidist.pipeline.executor import PipelineExecutor
from mpidist.pipeline.schedules import build_schedule
from mpidist.pipeline.stage import local_stages, materialize_stages, pipeline_layers
from mpidist.pipeline.timing import gather_events, plot_timeline
from mpidist.state import StateDict, flat_pieces, read_flat, read_params, replicated_pieces
from mpidist.strategy.base import Strategy
from mpidist.strategy.builders import build_compression, build_model_from_config, build_optimizer_from_config
from mpidist.strategy.compression_state import compression_pieces, compression_scalars, restore_compression
from mpidist.strategy.onebit import OnebitDriver, is_onebit

__all__ = ["PipelineStrategy"]

log = logging.getLogger("mpidist")


class PipelineStrategy(Strategy):
    """Pipeline parallelism combined with data parallelism (and optionally ZeRO-1)."""
    name = "pipeline"
    keys = ("stages", "microbatches", "schedule", "recompute", "virtual", "partition", "cuts", "zero")
    accumulates = False
    accumulation_hint = "; the pipeline's micro-batches already split each step: raise microbatches"

    @classmethod
    def config_errors(cls, parallel: dict, world_size: int | None = None) -> list[str]:
        errors = super().config_errors(parallel, world_size)
        if world_size is not None and world_size % parallel["stages"]:
            errors.append(f"[parallel] stages = {parallel['stages']} must divide the {world_size} ranks")
        return errors

    def __init__(self, config: dict, comm, meta: dict, *, dtype=np.float32,
                 make_optimizer=None):
        """dtype: of parameters, gradients and activations. make_optimizer(layout, offset,
        count): the optimizer of the stage's range (default: the config's [optim])."""
        super().__init__(config, comm, meta)
        p = config["parallel"]
        pp, m, virtual = p["stages"], p["microbatches"], p.get("virtual", 1)
        if comm.size % pp:
            raise ConfigError(f"[parallel] stages = {pp} must divide the {comm.size} ranks")
        self.grid = comm.grid(pp)
        dp = self.grid.dp
        batch = config["data"]["batch_size"]
        if batch % dp or (batch // dp) % m:
            raise ConfigError(f"[parallel] microbatches = {m} must divide each replica's rows: "
                              f"batch_size = {batch} over {dp} replicas; use a batch size "
                              f"divisible by {dp * m}")
        if not config["data"]["drop_last"]:
            raise ConfigError("[data] drop_last = false gives a short last batch that does not "
                              "split into equal micro-batches; set drop_last = true")
        try:
            self.schedule = build_schedule(p["schedule"], pp, m, virtual)
        except ValueError as exc:
            raise ConfigError(f"[parallel] schedule: {exc}") from None
        self.data_rank, self.data_size = self.grid.replica, dp
        self.tokens = int(meta["block"]) if meta.get("kind") == "lm" else 1
        self.model = build_model_from_config(config, meta)
        layers = pipeline_layers(self.model)
        num_stages = pp * virtual
        if num_stages > len(layers):
            raise ConfigError(f"{num_stages} pipeline stages (stages x virtual) but the model has "
                              f"only {len(layers)} layers; use fewer stages")
        costs = self._measure(batch // dp // m) if p.get("partition") == "cost" else None
        try:
            self.bounds = stage_bounds(p.get("partition", "params"), [l for _, l in layers],
                                       num_stages, cuts=p.get("cuts"), costs=costs)
        except ValueError as exc:
            raise ConfigError(f"[parallel] partition: {exc}") from None
        self.stages = local_stages(layers, self.bounds, pp, self.grid.stage)
        self.layout, self.params, self.grads = materialize_stages(
            self.model, self.stages, dtype=dtype, seed=config["job"]["seed"])
        self.zero = p.get("zero", 0) == 1 and dp > 1
        if self.zero:
            self.offset, self.count = self.layout.shard(self.grid.replica, dp)
        else:
            self.offset, self.count = 0, self.layout.numel
        if make_optimizer is None:
            def make_optimizer(layout, offset, count):
                return build_optimizer_from_config(config, layout, offset, count)
        self.optimizer = make_optimizer(self.layout, self.offset, self.count)
        self.loss = SoftmaxCrossEntropy()
        self.executor = PipelineExecutor(self.schedule, self.stages, self.grid.pp_comm,
                                         loss=self.loss, recompute=p["recompute"])
        self.algorithm = p["algorithm"]
        self.compressed = build_compression(config, self.grid.dp_comm)   # None: uncompressed
        self.onebit = None
        if is_onebit(self.optimizer):       # its momentum goes through the stage's dp group
            if self.zero:
                self.optimizer.reduce_max = lambda a: allreduce(
                    np.ascontiguousarray(a, dtype=np.float64), op="max", comm=self.grid.dp_comm)
            self.onebit = OnebitDriver(self.optimizer, self.layout, self.grid.dp_comm,
                                       mult=self.grid.dp_comm.size)
        self.last_stats = None
        if comm.rank == 0:
            names = [prefix.rstrip(".") or type(l).__name__.strip("_").lower()
                     for prefix, l in layers]
            cut = "; ".join(f"stage {s}: {', '.join(names[a:b])}"
                            for s, (a, b) in enumerate(zip(self.bounds, self.bounds[1:])))
            log.info("pipeline %s: %d stages x %d replicas, %d micro-batches, partition by %s "
                     "(%s)", self.schedule.name, pp, dp, m, p.get("partition", "params"), cut)

    def _measure(self, rows: int) -> list[float]:
        """Per-layer forward + backward seconds on a copy of the model, averaged over all
        ranks so every rank cuts the same way."""
        probe = copy.deepcopy(self.model)
        materialize(probe, dtype=np.float32, seed=0)
        probe_layers = pipeline_layers(probe)
        if self.meta.get("kind") == "lm":
            x = np.zeros((rows, int(self.meta["block"])), dtype=np.int64)
        else:
            x = np.zeros((rows, int(np.prod(self.meta["in_shape"]))), dtype=np.float32)
        costs = np.array(measure_layer_costs([l for _, l in probe_layers], x, steps=3))
        return list(allreduce(costs, op="avg", comm=self.comm))

    # ------------------------------------------------------------------ training
    def _reduce_norms(self, partial):
        return allreduce(partial, op="sum", comm=self.grid.dp_comm)

    def _compressed_sum(self):
        """The compressed sum of the stage's gradients over its replicas (an inf/NaN on any
        replica gives NaN everywhere, which the optimizer skips)."""
        return self.compressed.allreduce_async(self.grads.data, op="sum", layout=self.layout).wait()

    def train_step(self, x, y, global_count: int | None = None) -> dict:
        dp_comm = self.grid.dp_comm
        if global_count is None:
            global_count = dp_comm.comm.allreduce(len(x))
        scale = 1.0 / (global_count * self.tokens)
        self.grads.data[...] = 0
        t0 = time.perf_counter()
        stats = self.executor.run(x, y, scale=scale)
        t_pipe = time.perf_counter() - t0
        self.last_stats = stats
        t1 = time.perf_counter()
        if self.onebit is not None and self.onebit.frozen:
            # 1-2. (1-bit optimizer) the compressed momentum exchange and my range's update
            mine = self.params.data[self.offset:self.offset + self.count]
            info = self.onebit.step(mine, self.grads.data, reduce_norms=self._reduce_norms)
            if self.zero:
                allgather(mine.copy(), comm=dp_comm, out=self.params.data)
            t_comm, t_optim = time.perf_counter() - t1, 0.0
        elif self.zero:
            # 1'. reduce-scatter: my shard of the replicas' summed gradients (compressed:
            #     the compressed sum of the whole stage, of which I keep my shard)
            if self.compressed is not None:
                shard = self._compressed_sum()[self.offset:self.offset + self.count]
            else:
                shard = reduce_scatter(self.grads.data, op="sum", comm=dp_comm)
            t2 = time.perf_counter()
            # 2'. the optimizer on my shard of the stage's parameters
            mine = self.params.data[self.offset:self.offset + self.count]
            info = self.optimizer.step(mine, shard, reduce_norms=self._reduce_norms)
            t3 = time.perf_counter()
            # 3'. allgather of the updated shards (a copy of mine: no aliasing in MPI)
            allgather(mine.copy(), comm=dp_comm, out=self.params.data)
            t_comm = (t2 - t1) + (time.perf_counter() - t3)
            t_optim = t3 - t2
        else:
            # 1. gradients summed across the stage's replicas
            if self.compressed is not None:
                self.grads.data[...] = self._compressed_sum()
            elif dp_comm.size > 1:
                allreduce(self.grads.data, op="sum", algorithm=self.algorithm, comm=dp_comm)
            t2 = time.perf_counter()
            # 2. the optimizer on the stage's parameters
            info = self.optimizer.step(self.params.data, self.grads.data)
            t_comm, t_optim = t2 - t1, time.perf_counter() - t2
        totals = np.array([stats.loss_sum, stats.correct, len(x) * self.tokens], dtype=np.float64)
        dp_comm.comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
        self.step += 1
        # t_comm: the gradient exchange plus the pipeline's waiting (bubbles and transfers)
        return {"loss": float(totals[0] / max(totals[2], 1)), "correct": int(totals[1]),
                "count": int(totals[2]), "t_compute": stats.busy,
                "t_comm": t_comm + (t_pipe - stats.busy), "t_optim": t_optim,
                "skipped": bool(info.skipped), "lr": float(info.lr),
                "bubble": 1.0 - stats.busy / stats.wall if stats.wall > 0 else 0.0}

    def evaluate(self, x, y) -> dict:
        """Forward only, the whole batch as one micro-batch through the stages in order."""
        pp_comm, S = self.grid.pp_comm.comm, self.schedule.num_stages
        rows = 0 if x is None else len(x)
        loss_sum = correct = 0.0
        if rows:
            h = x
            for s in range(S):
                owner = self.schedule.rank_of(s)
                if owner != pp_comm.rank:
                    continue
                if s > 0 and self.schedule.rank_of(s - 1) != owner:
                    h = pp_comm.recv(source=self.schedule.rank_of(s - 1), tag=s)
                h = self.stages[s].forward(h, train=False)
                if s == S - 1:
                    loss_sum, correct = self.loss.forward(h, y)
                elif self.schedule.rank_of(s + 1) != owner:
                    pp_comm.send(h, dest=self.schedule.rank_of(s + 1), tag=s + 1)
        last = self.schedule.rank_of(S - 1) == pp_comm.rank
        count = rows * self.tokens if last else 0
        totals = np.array([loss_sum, correct, count], dtype=np.float64)
        self.comm.comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
        return {"loss": float(totals[0]), "correct": int(totals[1]), "count": int(totals[2])}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> StateDict:
        r, n = self.grid.replica, self.grid.dp
        tensors = replicated_pieces("params", self.layout, self.params.data, r, n)
        for name, buf in sorted(self.optimizer.state_buffers().items()):
            if self.zero:
                tensors.update(flat_pieces(f"optim/{name}", self.layout, buf, self.offset))
            else:
                tensors.update(replicated_pieces(f"optim/{name}", self.layout, buf, r, n))
        scalars = {"optim_step": self.optimizer.step_count, "optim": self.optimizer.name,
                   "optim_extra": self.optimizer.extra_state()}
        if self.compressed is not None:     # this replica's residuals of its stage's tensors
            tensors.update(compression_pieces(self.compressed, self.layout, r, n))
            scalars["compression"] = compression_scalars(self.compressed)
        if self.onebit is not None:         # the 1-bit exchange's, per stage and replica
            tensors.update(self.onebit.pieces(r, n))
            scalars.update(self.onebit.scalars())
        return StateDict(self.step, tensors, scalars)

    def load_state_dict(self, source) -> None:
        read_params(source, self.layout, self.params.data)
        for name, buf in self.optimizer.state_buffers().items():
            read_flat(source, f"optim/{name}", self.layout, buf, lo=self.offset)
        self.optimizer.step_count = int(source.scalars.get("optim_step", source.step))
        if "optim_extra" in source.scalars:
            self.optimizer.load_extra_state(source.scalars["optim_extra"])
        if self.compressed is not None:
            restore_compression(self.compressed, source, self.layout, [(0, self.layout.numel)],
                                self.grid.replica, self.grid.dp)
        if self.onebit is not None:
            self.onebit.restore(source, [(0, self.layout.numel)], self.grid.replica, self.grid.dp)
        self.step = int(source.step)
        self.grads.data[...] = 0

    def close(self) -> None:
        """Collective: replica 0 draws its last step as it ran into
        <out_dir>/pipeline_timeline.png (when the job plots)."""
        if self.last_stats is None or not self.config["job"]["plot"] or self.grid.replica:
            return
        events = gather_events(self.last_stats, self.grid.pp_comm)
        if self.grid.pp_comm.rank == 0:
            out = self.config["job"]["out_dir"]
            os.makedirs(out, exist_ok=True)
            s = self.schedule
            plot_timeline(events, os.path.join(out, "pipeline_timeline.png"),
                          f"{s.name}: p={s.pp}, m={s.microbatches}, step {self.step} of "
                          f"replica 0", virtual=s.virtual, pp=s.pp)

    def memory_report(self) -> dict:
        optim = sum(int(b.nbytes) for b in self.optimizer.state_buffers().values())
        rep = {"params": int(self.params.data.nbytes), "grads": int(self.grads.data.nbytes),
               "optim": optim}
        if self.last_stats is not None:
            rep["activations"] = int(self.last_stats.peak_stash_bytes)
        rep["total"] = sum(rep.values())
        return rep
