"""The training loop's checkpoint hook (made by mpidist.engine.loop).

Saves every [checkpoint] interval steps and at the end, resumes from the newest good
checkpoint (on any rank count and strategy whose tensors match), and turns SIGTERM/SIGUSR1
into "finish this step, checkpoint, exit REQUEUE_EXIT_CODE" on every rank.

It acts only where every rank stands at the same step: after every step for synchronous
strategies; for the parameter server after the steps its at_boundary() marks (attach()
hands it the preemption flag, so a signal brings the next boundary soon).
"""
from __future__ import annotations

import logging

import numpy as np

from mpidist.checkpoint import format as fmt
from mpidist.checkpoint.manager import CheckpointManager
from mpidist.checkpoint.signals import REQUEUE_EXIT_CODE, Preemption
from mpidist.errors import agree_or_raise
from mpidist.state import MODEL_PREFIXES

__all__ = ["CheckpointHook"]

log = logging.getLogger("mpidist")


class CheckpointHook:
    """Collective construction; resume / after_step / close are called on every rank."""

    def __init__(self, config: dict, comm):
        c = config["checkpoint"]
        self.config = config
        self.comm = comm
        self.interval = int(c["interval"])
        self.manager = CheckpointManager(c["dir"], keep=c["keep"], comm=comm)
        self.preemption = Preemption(comm).install()
        self.saved_step: int | None = None
        self.checked_step = 0                 # step of the last boundary seen

    def attach(self, strategy) -> None:
        """Before training: an asynchronous strategy stops at a common step once this rank is
        signalled (strategies that meet at every step have no pause_on)."""
        pause_on = getattr(strategy, "pause_on", None)
        if pause_on is not None:
            pause_on(lambda: self.preemption.requested)

    def resume(self, strategy) -> bool:
        """Collective: load the newest good checkpoint into strategy; False if there is none."""
        src = self.manager.open_latest()
        if src is None:
            if self.comm.rank == 0:
                log.info("no checkpoint in %s: starting from step 0", self.manager.directory)
            return False
        with src:
            src.require(_expected_shapes(strategy, self.comm))
            err = None
            try:
                strategy.load_state_dict(src)
            except Exception as exc:  # noqa: BLE001 - raised on every rank by agree_or_raise
                err = exc
            agree_or_raise(self.comm, err, fmt.CheckpointError)
            if src.world_size == self.comm.size and len(src.rank_meta) == self.comm.size:
                mine = src.rank_meta[self.comm.rank]
                state = mine.get("numpy_rng")
                if state is not None:
                    np.random.set_state(tuple(state))
                # dropout masks continue only where every rank has the same rows and layers
                states, generators = mine.get("model_rng"), _generators(strategy)
                if states is not None and len(states) == len(generators) and \
                        src.meta.get("config", {}).get("parallel") == self.config["parallel"]:
                    for g, s in zip(generators, states):
                        g.bit_generator.state = s
            if self.comm.rank == 0:
                log.info("resumed from %s (step %d, written by %d ranks, %s)", src.path, src.step,
                         src.world_size, src.meta.get("strategy", "?"))
        self.saved_step = self.checked_step = strategy.step
        return True

    def after_step(self, strategy, last: bool) -> None:
        """Collective at a boundary: save when a multiple of the interval was reached since the
        last boundary, and at the end; on a preemption signal save and exit."""
        if not getattr(strategy, "at_boundary", lambda: True)():
            return
        step, previous = strategy.step, self.checked_step
        self.checked_step = step
        if (self.interval and step // self.interval > previous // self.interval) or last:
            self.save(strategy)
        if self.preemption.should_stop():
            if self.saved_step != step:
                self.save(strategy)
            if self.comm.rank == 0:
                log.warning("preempted (signal %s on some rank): checkpoint at step %d written, "
                            "exiting with %d for requeue", self.preemption.received, step,
                            REQUEUE_EXIT_CODE)
            raise SystemExit(REQUEUE_EXIT_CODE)

    def save(self, strategy) -> str:
        sd = strategy.state_dict()
        job = self.config["job"]
        per_epoch = int(job.get("steps_per_epoch") or 0)
        epoch, batch = divmod(sd.step, per_epoch) if per_epoch else (None, None)
        rng = np.random.get_state()
        path = self.manager.save(
            sd.step, sd.tensors, epoch=epoch, scalars=sd.scalars,
            meta={"config": self.config, "strategy": self.config["parallel"]["strategy"],
                  "loader": {"epoch": epoch, "batch": batch, "seed": job.get("seed")}},
            rank_meta={"numpy_rng": [rng[0], rng[1].tolist(), *rng[2:]],
                       "model_rng": [g.bit_generator.state for g in _generators(strategy)]})
        self.saved_step = sd.step
        return path

    def close(self) -> None:
        self.preemption.uninstall()


def _generators(strategy) -> list:
    """The random generators (dropout) of the model this rank runs; none without a model."""
    model = getattr(strategy, "model", None)
    return model.generators() if model is not None else []


def _expected_shapes(strategy, comm) -> dict:
    """Collective: every model tensor key (params/, optim/) the strategy holds anywhere, with
    its global shape; run state (compression residuals, ps clocks) is optional, and so are
    the fp32 masters of 16-bit parameters (optim/master/: a full-precision checkpoint has
    none, and read_params takes them from its params/)."""
    mine = {k: tuple(p.shape) for k, p in strategy.state_dict().tensors.items()
            if k.startswith(MODEL_PREFIXES) and not k.startswith("optim/master/")}
    shapes: dict = {}
    for part in comm.comm.allgather(mine):
        shapes.update(part)
    return shapes
