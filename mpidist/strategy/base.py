"""Strategy: one way of spreading a training step over ranks (dp, zero, pipeline, ps, admm).

The training loop (engine.loop) knows nothing of how a step is parallelised; it builds the
configured strategy (engine.strategies.build_strategy) and drives it:

    for each step:  metrics = strategy.train_step(x, y, global_count=B)
    strategy.evaluate(x, y); strategy.state_dict(); strategy.load_state_dict(source)

Data: the rank with data_rank r of data_size replicas gets rows chunk(B, r, data_size) of
every global batch (data_rank None: none, e.g. a parameter server); every rank calls
train_step once per step, so collectives stay matched. State: pieces of global tensors
(mpidist.state). A strategy also says which [parallel] keys are its own and which settings
it cannot honour, so engine.config reports them. See docs/ARCHITECTURE.md ("Strategy").
"""
from __future__ import annotations

import abc

from mpidist.errors import ConfigError
from mpidist.partition import chunk
from mpidist.state import StateDict

__all__ = ["Strategy", "METRIC_KEYS"]

# Keys every train_step result has (values identical on all ranks except the t_* timings).
METRIC_KEYS = ("loss", "correct", "count", "t_compute", "t_comm", "t_optim")


class Strategy(abc.ABC):
    """Base class of dp / zero / pipeline / ps / admm.

    config: the validated job config (plain nested dict, every key present, see engine.config),
      plus config["job"]["total_steps"] filled in by the loop;
    comm: the mpidist Communicator of the whole job; meta: the dataset's metadata
    ({"kind": "classification", "in_shape", "classes"} or {"kind": "lm", "vocab", "block"}).
    Subclasses set data_rank / data_size if their data split is not one replica per rank.
    """
    name = "base"
    keys: tuple = ()            # [parallel] keys only this strategy reads (set elsewhere: an error)
    compresses = True           # honours [parallel] compression
    accumulates = True          # honours [parallel] accumulation
    accumulation_hint = "; remove it"

    def __init__(self, config: dict, comm, meta: dict):
        self.check_support(config)
        self.config = config
        self.comm = comm
        self.meta = meta
        self.data_rank: int | None = comm.rank
        self.data_size: int = comm.size
        self.step = 0

    @classmethod
    def config_errors(cls, parallel: dict, world_size: int | None = None) -> list[str]:
        """The [parallel] settings this strategy cannot honour (on world_size ranks, where
        given), as messages (none if it can)."""
        errors = []
        if parallel["compression"] != "none" and not cls.compresses:
            errors.append(f"[parallel] compression = {parallel['compression']!r}: strategy = "
                          f"{cls.name!r} exchanges no gradients by allreduce; remove it "
                          f"(compression works with dp, zero and pipeline)")
        if parallel["accumulation"] != 1 and not cls.accumulates:
            errors.append(f"[parallel] accumulation = {parallel['accumulation']} is not supported "
                          f"with strategy = {cls.name!r}{cls.accumulation_hint}")
        return errors

    @classmethod
    def check_support(cls, config: dict) -> None:
        """ConfigError for config_errors (a config built without engine.config.validate)."""
        errors = cls.config_errors(config["parallel"])
        if errors:
            raise ConfigError("\n".join(errors))

    def shard_rows(self, batch_size: int) -> tuple[int, int]:
        """(offset, count) of this rank's rows in a global batch (count 0 when it reads none)."""
        if self.data_rank is None:
            return 0, 0
        return chunk(batch_size, self.data_rank, self.data_size)

    @abc.abstractmethod
    def train_step(self, x, y, global_count: int | None = None) -> dict:
        """One optimisation step on this rank's rows of the global batch.

        global_count: samples in the whole global batch (the loop knows it from the sampler;
        the loss is the mean over them). Returns at least METRIC_KEYS: loss (global mean),
        correct and count (global sums; tokens for a language model), and this rank's
        t_compute / t_comm / t_optim in seconds. Must increment self.step.
        """

    @abc.abstractmethod
    def evaluate(self, x, y) -> dict:
        """Loss summed, correct and count over the global evaluation batch (same on all ranks)."""

    @abc.abstractmethod
    def state_dict(self) -> StateDict:
        """This rank's pieces of the global tensors (mpidist.state).

        Keys under MODEL_PREFIXES ("params/", "optim/") must all be in a checkpoint that is
        loaded; other keys are run state, loaded when present and started afresh when not.
        """

    @abc.abstractmethod
    def load_state_dict(self, source) -> None:
        """Collective: restore from a source with .step, .scalars, .keys(), .shape(key),
        .read(key, offset, count), whatever world size wrote it."""

    def replica_state_dict(self) -> StateDict:
        """Local: the whole state, as the one rank of a one-rank job would give it, where every
        rank holds all of it (dp). What the survivors of a lost rank continue from (mpidist.ft).
        A strategy whose ranks hold shards has none."""
        raise NotImplementedError(f"strategy {self.name!r} holds no whole replica on a rank")

    @abc.abstractmethod
    def memory_report(self) -> dict:
        """Bytes this rank holds: {"params", "grads", "optim", "activations"(if known), "total"}."""

    def close(self) -> None:
        """Release communicators or threads the strategy made (collective)."""
