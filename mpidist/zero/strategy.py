"""`strategy = "zero"` in a job config: [parallel] stage = 1 | 2 | 3, dtype, bucket_mb,
accumulation, compression (stage 1: by the compressed allreduce, as dp with bucket_mb = 0;
stages 2, 3: each bucket by the compressed reduce-scatter, so not powersgd).

Every rank is a data-parallel replica reading its rows of the global batch (as with "dp");
the model states are partitioned over the ranks as the stage says. Loss and gradients are
normalised as dp does them, so a ZeRO run follows the dp run of the same config step for
step. dtype = "bfloat16" / "float16" keeps parameters and gradients in two bytes with fp32
masters in the optimizer. Each rank's memory report is logged at start and returned in every
step's metrics (mem_* keys). [parallel] algorithm does not apply: stage 1 uses the ring
reduce-scatter and allgather, stages 2 and 3 the exchanges of mpidist.zero.exchange.
"""
from __future__ import annotations

import logging

from mpidist.compress import COMPRESSORS
from mpidist.errors import ConfigError
from mpidist.optim import build_optimizer
from mpidist.state import StateDict
from mpidist.strategy.base import Strategy
from mpidist.strategy.builders import build_compression, build_model_from_config, lr_schedule
from mpidist.zero import build_zero, check_stage

__all__ = ["ZeroStrategy"]

log = logging.getLogger("mpidist")


class ZeroStrategy(Strategy):
    """ZeRO stage 1, 2 or 3 over the whole communicator (one data-parallel group)."""
    name = "zero"
    keys = ("stage", "dtype")

    @classmethod
    def config_errors(cls, parallel: dict, world_size: int | None = None) -> list[str]:
        """Compression at stages 2 and 3 needs payloads that decode one by one."""
        errors = super().config_errors(parallel, world_size)
        compressor = COMPRESSORS.get(parallel["compression"])   # an unknown name: engine.config's
        if parallel["stage"] != 1 and not getattr(compressor, "decodes_alone", True):
            errors.append(f"[parallel] compression = {parallel['compression']!r} works with zero "
                          f"stage = 1 only (stages 2 and 3 reduce-scatter gradient buckets, and "
                          f"its payloads decode only once summed over all ranks); use stage = 1 "
                          f"or another compressor")
        return errors

    def __init__(self, config: dict, comm, meta: dict):
        super().__init__(config, comm, meta)
        p, o = config["parallel"], config["optim"]
        try:
            stage = check_stage(p["stage"])
        except ValueError as exc:
            raise ConfigError(f"[parallel] {exc}") from None

        def make_optimizer(layout, offset, count, dtype):
            return build_optimizer(o["name"], layout, lr=lr_schedule(config), **o["hyper"],
                                   offset=offset, count=count, param_dtype=dtype)

        self.engine = build_zero(stage, build_model_from_config(config, meta), make_optimizer,
                                 comm=comm, dtype=p["dtype"], seed=config["job"]["seed"],
                                 bucket_mb=p["bucket_mb"], accumulation=p["accumulation"],
                                 compression=build_compression(config, comm))
        self.tokens = int(meta["block"]) if meta.get("kind") == "lm" else 1
        reports = comm.comm.gather(self.engine.memory_report().format(), root=0)
        if comm.rank == 0:
            for line in reports:
                log.info("memory at start: %s", line)

    @property
    def model(self):
        """The mpidist.nn model this rank runs (the checkpoint hook saves its dropout generators)."""
        return self.engine.model

    def train_step(self, x, y, global_count: int | None = None) -> dict:
        if global_count is not None:
            global_count *= self.tokens
        m = self.engine.train_step(x, y, global_count)
        self.step = self.engine.step
        m["lr"] = self.engine.info.lr
        m.update(self.engine.memory_report().as_metrics())
        return m

    def evaluate(self, x, y) -> dict:
        return self.engine.evaluate(x, y)

    def state_dict(self) -> StateDict:
        return self.engine.state_dict()

    def load_state_dict(self, source) -> None:
        self.engine.load_state_dict(source)
        self.step = self.engine.step

    def memory_report(self) -> dict:
        rep = self.engine.memory_report()
        out = {k: getattr(rep, k) for k in ("params", "grads", "optim", "workspace",
                                             "in_flight", "peak_in_flight")}
        out["total"] = rep.model_states + rep.workspace + rep.in_flight
        return out
