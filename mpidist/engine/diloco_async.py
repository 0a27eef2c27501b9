"""`strategy = "diloco_async"`: DiLoCo whose outer step goes through the parameter server,
so groups of different speeds never wait for each other (mpidist.diloco.asynchronous;
Liu et al. 2024, asynchronous local SGD with delayed Nesterov).

[parallel] servers (ranks that hold theta_outer and train nothing), group_size (the other
ranks, a group per node by default), sync_every (H), outer_lr and outer_momentum (as
diloco's: with one push from each group per outer_delay pushes they give the same step),
outer_delay (pushes per momentum step; 0 = the number of groups), straggler and
straggler_mode (seconds of sleep per inner step on the last group, or a random group per
step, as ps). Every worker reads its rows chunk(B, w, W) of each global batch.

Steps: the budget is diloco's, G * total_steps inner steps in rounds of H; a group's step
is the job's progress, H * (rounds claimed before its current one) / G, and reaches the
total once the budget is spent and every push is applied. Metrics and evaluation during
training are the group's own; the final evaluation is the whole world's on the final
theta_outer. A checkpoint is written at the end only (params/ theta_outer, the servers'
optim/outer_momentum_buffer/, loadable by diloco at any world size); resuming from one of
diloco's or of this strategy starts a new asynchronous run from its theta_outer and momentum.
"""
from __future__ import annotations

import logging

import numpy as np

from mpidist.diloco.asynchronous import AsyncOuter, split_servers
from mpidist.engine.dp import DataParallel
from mpidist.errors import ConfigError
from mpidist.nn import materialize
from mpidist.partition import chunk
from mpidist.ps.consistency import Straggler
from mpidist.ps.server import servers_error
from mpidist.state import StateDict, flat_pieces, read_flat, read_params, replicated_pieces
from mpidist.strategy.base import Strategy
from mpidist.strategy.builders import build_model_from_config

__all__ = ["AsyncDiLoCo"]

log = logging.getLogger("mpidist")


class AsyncDiLoCo(Strategy):
    """Asynchronous DiLoCo: server ranks serve, each group of the others runs its rounds."""
    name = "diloco_async"
    keys = ("group_size", "sync_every", "outer_lr", "outer_momentum", "outer_delay", "servers",
            "straggler", "straggler_mode")
    compresses = False

    @classmethod
    def config_errors(cls, parallel: dict, world_size: int | None = None) -> list[str]:
        return super().config_errors(parallel, world_size) + servers_error(parallel["servers"], world_size)

    def __init__(self, config: dict, comm, meta: dict, *, timeout: float = 300.0):
        super().__init__(config, comm, meta)
        if config["checkpoint"]["interval"]:
            raise ConfigError("[checkpoint] interval: strategy = 'diloco_async' checkpoints at the "
                              "end only (its groups never stand at one step); set interval = 0")
        p = config["parallel"]
        self.topo = split_servers(comm, p["servers"], p["group_size"])
        G, g = self.topo.count, self.topo.groups
        self.total_steps = int(config["job"]["total_steps"])
        self.sync_every = int(p["sync_every"])
        rounds = -(-G * self.total_steps // self.sync_every)
        self.inner = None
        if g is not None:             # a worker: data parallel within its group
            self.inner = DataParallel(config, g.group, meta)
            self.model, self.layout, params = self.inner.model, self.inner.layout, self.inner.params.data
            self.data_rank, self.data_size = self.topo.workers.index(comm.rank), len(self.topo.workers)
        else:                         # a server: the model's layout and initial parameters
            self.model = build_model_from_config(config, meta)
            self.layout, flat, _ = materialize(self.model, dtype=np.float32, seed=config["job"]["seed"])
            params = flat.data
            self.data_rank, self.data_size = None, len(self.topo.workers)
        self.params = params
        self.outer = AsyncOuter(params, self.layout, self.topo, rounds=rounds, lr=p["outer_lr"],
                                momentum=p["outer_momentum"], delay=p["outer_delay"], timeout=timeout)
        self.straggler = None
        if p["straggler"] > 0:
            self.straggler = Straggler(worker=G - 1 if p["straggler_mode"] == "fixed" else None,
                                       delay=p["straggler"], seed=config["job"]["seed"])
        self.in_round = 0                 # inner steps of my group's current round
        self.finished = False

    # ------------------------------------------------------------------ training
    def train_step(self, x, y, global_count: int | None = None) -> dict:
        try:
            return self._serve() if self.inner is None else self._work(x, y, global_count)
        except Exception:
            self.outer.abort()            # the others' waits fail now, not at their timeout
            raise

    def _work(self, x, y, global_count) -> dict:
        if global_count is None:
            raise ValueError("strategy 'diloco_async' needs global_count (its groups can not "
                             "agree on it per step)")
        g, out = self.topo.groups, self.outer
        t_comm = out.t_comm
        if out.round < 0 and not out.begin(self.params):     # the first round (or none left)
            return self._finish(self._empty(out.t_comm - t_comm))
        if self.straggler is not None:
            self.straggler.stall(g.index, self.inner.step, self.topo.count)
        rows = sum(chunk(global_count, w, self.data_size)[1] for w in g.members)   # worker indices
        m = self.inner.train_step(x, y, global_count=rows)
        self.in_round += 1
        more = True
        if self.in_round >= self.sync_every:
            more = out.sync(self.params)
            self.in_round = 0
        m = {**m, "t_comm": m["t_comm"] + out.t_comm - t_comm, "round": out.round}
        if not more:
            return self._finish(m)
        self.step = min(self.total_steps, out.round * self.sync_every // self.topo.count)
        return m

    def _serve(self) -> dict:
        """A server's step serves the whole run."""
        stats = self.outer.serve()
        return self._finish({**self._empty(0.0), "t_optim": stats.apply_time})

    def _finish(self, metrics: dict) -> dict:
        """Collective over the world, every group out of rounds: the final theta_outer on
        every rank, and the job at its last step."""
        self.outer.finalize(self.params)
        self.step, self.finished = self.total_steps, True
        return metrics

    @staticmethod
    def _empty(t_comm: float) -> dict:
        return {"loss": 0.0, "correct": 0, "count": 0, "t_compute": 0.0, "t_comm": t_comm, "t_optim": 0.0}

    def at_boundary(self) -> bool:
        """Checkpoints only once every group has stopped."""
        return self.finished

    def evaluate(self, x, y) -> dict:
        """During training: my group's rows with its current model (within the group);
        after it: every rank's rows with the final theta_outer (over the world)."""
        if not self.finished:
            return self.inner.evaluate(x, y)
        loss_sum = correct = count = 0.0
        if self.inner is not None and x is not None and len(x):
            logits = self.inner.predict(x)
            loss_sum, correct = self.inner.loss.forward(logits, self.inner.xp.asarray(y))
            count = len(x) * self.inner.tokens
        totals = self.comm.comm.allreduce(np.array([loss_sum, correct, count], dtype=np.float64))
        return {"loss": float(totals[0]), "correct": int(totals[1]), "count": int(totals[2])}

    def report(self) -> dict:
        """Collective: rounds pushed per group and their leaders' seconds in the exchange."""
        return self.outer.report()

    # ------------------------------------------------------------------ state
    def _momentum(self):
        """(offset, buffer) of a server's outer momentum shard; None elsewhere or without momentum."""
        srv = self.outer.ps.server
        buf = None if srv is None else srv.optimizer.state_buffers().get("momentum_buffer")
        return None if buf is None else (srv.optimizer.offset, buf)

    def state_dict(self) -> StateDict:
        r, s = self.comm.rank, self.comm.size
        tensors = replicated_pieces("params", self.layout, self.params, r, s)
        shard = self._momentum()
        if shard is not None:
            tensors.update(flat_pieces("optim/outer_momentum_buffer", self.layout, shard[1], shard[0]))
        return StateDict(self.step, tensors, {"diloco_groups": self.topo.count})

    def load_state_dict(self, source) -> None:
        """Collective: theta_outer (and the outer momentum, where written) from diloco's or
        this strategy's checkpoint, at any world size; a new run of rounds from its step."""
        error = None
        theta = np.empty(self.layout.numel, np.float32)
        try:
            read_params(source, self.layout, theta)
            shard = self._momentum()
            if shard is not None and f"optim/outer_momentum_buffer/{self.layout.segments[0].name}" in source.keys():
                read_flat(source, "optim/outer_momentum_buffer", self.layout, shard[1], shard[0])
        except (KeyError, TypeError, ValueError) as exc:
            error = exc
        self.comm.raise_if_any(error)
        self.step = min(int(source.step), self.total_steps)
        done = -(-self.topo.count * self.step // self.sync_every)
        self.outer.restore(theta, done)
        xp = np if self.inner is None else self.inner.xp
        self.params[...] = xp.asarray(theta)
        if self.inner is not None:    # the inner schedule goes on from the step (fresh moments)
            self.inner.step = self.step
            self.inner.optimizer.step_count = int(source.scalars.get("optim_step", self.step))
            self.inner.dopt.zero_grad()
        self.finished = self.step >= self.total_steps

    def memory_report(self) -> dict:
        if self.inner is not None:
            rep = self.inner.memory_report()
            rep["optim"] += int(self.outer.start.nbytes)
            rep["total"] += int(self.outer.start.nbytes)
            return rep
        opt = self.outer.ps.server.optimizer
        optim = int(opt.buffer.nbytes + opt.momentum_buffer.nbytes)
        rep = {"params": int(self.params.nbytes), "grads": 0, "optim": optim}
        rep["total"] = sum(rep.values())
        return rep

    def close(self) -> None:
        """Collective: rank 0 logs the rounds of each group; the windows are freed."""
        stats = self.report()
        if self.comm.rank == 0:
            log.info("diloco_async: %d groups pushed %s rounds (leaders' exchange seconds %s)",
                     stats["groups"], stats["rounds"], [round(t, 3) for t in stats["t_comm"]])
        self.outer.close()
        if self.inner is not None:
            self.inner.close()
