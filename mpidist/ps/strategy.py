"""`strategy = "ps"`: training through the parameter server (consistency, servers,
staleness, straggler, straggler_mode in the job's [parallel] section).

Server ranks (placed by the topology) hold the optimizer of their shard and read no data
(data_rank None); the W workers read rows chunk(B, w, W) of every global batch. A worker's
step: pull (waiting as BSP/SSP demand), forward/backward with the loss scaled by W / B,
push; the servers apply mean-over-workers gradients, so BSP trains exactly like
data-parallel SGD with the same global batch. Under ASP/SSP steps count the servers'
updates, not a worker's pushes, and checkpoints are taken at boundaries where every rank
stands at the same step (ParameterServerStrategy says how). See docs/ARCHITECTURE.md
("Parameter server and ADMM").
"""
from __future__ import annotations

import json
import logging
import os
import time

import numpy as np

from mpidist.errors import ConfigError
from mpidist.nn import SoftmaxCrossEntropy, materialize
from mpidist.ps.consistency import Consistency, Straggler, format_histogram
from mpidist.ps.server import ParameterServer, servers_error
from mpidist.state import StateDict, TensorPiece, flat_pieces, read_flat, read_params
from mpidist.strategy.base import Strategy
from mpidist.strategy.builders import build_model_from_config, build_optimizer_from_config

__all__ = ["ParameterServerStrategy"]

log = logging.getLogger("mpidist")


class ParameterServerStrategy(Strategy):
    """[parallel] strategy = "ps": consistency, servers, staleness, straggler, straggler_mode.

    Steps count updates, not pushes. Under BSP every worker makes every step. Under ASP/SSP
    a worker's step is the servers' count of applied pushes / W (it may stay put for a call
    while the servers catch up), so fast workers take over the work of a straggler and every
    worker stops once the servers have made the configured number of steps' worth of updates.

    Evaluation: while a worker is still training it evaluates its own rows of the test set
    with its latest parameters (no synchronisation of asynchronous workers); after its last
    step it waits for the final parameters, and the final evaluation is summed over all
    ranks (servers contribute nothing), so every rank reports the same figures.

    Segments. Server ranks train nothing: a server's train_step serves until every worker
    has stopped at a common boundary: the end of the run, a checkpoint step ([checkpoint]
    interval), or a pause some rank asked for (a preemption signal, see pause_on). Every
    rank then agrees on the step (the servers' applied pushes / W), at_boundary() is True,
    and the checkpoint hook may save: each server writes its chunk() of the parameters and
    of its optimizer state, each worker its clock (ps/clock, (W,)), so the file holds the
    same params/ and optim/ tensors as a data-parallel one. Between boundaries a worker's
    steps are its own (at_boundary() False). Resuming reads the shards by chunk() for any
    number of servers, and the clocks when the number of workers is the same (else every
    worker starts at the step); a data-parallel or ZeRO checkpoint loads too, and a ps one
    into them.
    """
    name = "ps"
    keys = ("consistency", "servers", "staleness", "straggler", "straggler_mode")
    compresses = accumulates = False

    @classmethod
    def config_errors(cls, parallel: dict, world_size: int | None = None) -> list[str]:
        return super().config_errors(parallel, world_size) + servers_error(parallel["servers"], world_size)

    def __init__(self, config: dict, comm, meta: dict, *, timeout: float = 300.0):
        super().__init__(config, comm, meta)
        p = config["parallel"]
        if p["consistency"] != "ssp" and p["staleness"]:
            raise ConfigError("[parallel] staleness applies to consistency = 'ssp' only")
        model = Consistency(p["consistency"], p["staleness"])
        self.model = build_model_from_config(config, meta)
        self.layout, self.params, self.grads = materialize(self.model, dtype=np.float32,
                                                           seed=config["job"]["seed"])
        self.total_steps = config["job"]["total_steps"]
        workers = comm.size - p["servers"]
        straggler = None
        if p["straggler"] > 0:         # fixed: the last worker; random: one per step, by seed
            straggler = Straggler(worker=workers - 1 if p["straggler_mode"] == "fixed" else None,
                                  delay=p["straggler"], seed=config["job"]["seed"])
        self.ps = ParameterServer(
            self.params.data, comm=comm, servers=p["servers"], consistency=model,
            optimizer=lambda off, cnt: build_optimizer_from_config(config, self.layout, off, cnt),
            straggler=straggler, timeout=timeout)
        self.worker = self.ps.worker
        self.data_rank, self.data_size = self.ps.worker_index, self.ps.num_workers
        self.loss = SoftmaxCrossEntropy()
        self.pushes = 0
        self._finished = False
        self.interval = config["checkpoint"]["interval"]
        self._requested = None             # pause_on's callable
        self._boundary = True              # every rank stands at the same step
        self._segment_start = 0            # step of the last boundary
        self._optim_steps = [0] * len(self.ps.server_ranks)

    # ------------------------------------------------------------------ training
    def train_step(self, x, y, global_count: int | None = None) -> dict:
        try:
            return self._serve() if self.worker is None else self._work(x, y, global_count)
        except Exception:
            self.ps.abort()            # the other ranks' waits fail now, not at their timeout
            raise

    def at_boundary(self) -> bool:
        """True after a train_step that ended a segment (every rank at the same step)."""
        return self._boundary

    def pause_on(self, requested) -> None:
        """requested() -> bool, True once this rank was signalled: every rank then stops at
        the next common step boundary (the checkpoint hook passes its preemption flag)."""
        self._requested = requested

    def _asked(self) -> bool:
        return self._requested is not None and self._requested()

    def _work(self, x, y, global_count) -> dict:
        if global_count is None:
            raise ValueError("strategy 'ps' needs global_count (asynchronous workers can not "
                             "agree on it per step)")
        W = self.data_size
        self._boundary = False
        # 1. pull (BSP / SSP wait here)
        t0 = time.perf_counter()
        self.worker.pull(out=self.params.data)
        t1 = time.perf_counter()
        # 2. gradient of my rows, scaled so the servers' mean over workers is the
        #    global-batch mean
        self.grads.data[...] = 0
        logits = self.model.forward(x, train=True)
        loss_sum, correct = self.loss.forward(logits, y)
        self.model.backward(self.loss.backward(W / global_count))
        t2 = time.perf_counter()
        # 3. push (a straggler sleeps here)
        self.worker.push(self.grads.data)
        self.pushes += 1
        if self.ps.consistency.model == "bsp":
            self.step += 1                 # lockstep: every worker makes every step
        else:                              # steps' worth of updates, by all workers
            self.step = min(max(self.step, self.worker.global_clock()), self.total_steps)
        # 4. the end of a segment: the run's end, a checkpoint step, or an asked-for pause
        #    (neither without an interval or a pause_on: a run without checkpoints)
        if self.step >= self.total_steps:
            self.worker.finish()
            self._meet()
        elif self.interval or self._requested is not None:
            scheduled = bool(self.interval) and \
                self.step // self.interval > self._segment_start // self.interval
            if self._asked() or (scheduled and self.ps.consistency.model != "bsp"):
                self.worker.request_pause()       # the others stop after their current push
            if self.worker.stop_here(scheduled):
                self._meet()
        t3 = time.perf_counter()
        return {"loss": float(loss_sum) / max(len(x), 1), "correct": int(correct), "count": len(x),
                "t_compute": t2 - t1, "t_comm": (t1 - t0) + (t3 - t2), "t_optim": 0.0,
                "pushes": self.pushes}

    def _serve(self) -> dict:
        """A server's step serves a whole segment; it reports no samples of its own."""
        t0 = time.perf_counter()
        applying = self.ps.server.stats.apply_time
        stats = self.ps.serve(self._requested)
        self._meet()
        t_optim = stats.apply_time - applying
        return {"loss": 0.0, "correct": 0, "count": 0, "t_compute": 0.0,
                "t_comm": time.perf_counter() - t0 - t_optim, "t_optim": t_optim}

    def _meet(self) -> None:
        """Collective, every rank stopped: agree on the step (servers' applied pushes / W);
        at the end of the run every worker takes the final parameters."""
        info = self.ps.end_segment()
        self.step = min(int(info["clocks"].sum()) // self.data_size, self.total_steps)
        self._optim_steps = info["optim_steps"]
        self._segment_start = self.step
        self._boundary = True
        if self.step >= self.total_steps:
            final = self.ps.parameters()
            if self.worker is not None:
                self.params.data[...] = final
            self._finished = True

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, x, y) -> dict:
        """After training: summed over all ranks (servers add nothing), the same everywhere.
        During training: this worker's rows only, with its latest parameters."""
        loss_sum = correct = 0.0
        count = 0 if x is None else len(x)
        if count:
            loss_sum, correct = self.loss.forward(self.model.forward(x, train=False), y)
        sums = np.array([loss_sum, correct, count], dtype=np.float64)
        if self._finished:
            sums = self.comm.comm.allreduce(sums)
        return {"loss": float(sums[0]), "correct": int(sums[1]), "count": int(sums[2])}

    def report(self) -> dict:
        """Collective: the run's staleness histogram, SSP gap and waits (ps.stats())."""
        stats = self.ps.stats()
        stats["histogram_text"] = format_histogram(stats["staleness_histogram"])
        return stats

    # ------------------------------------------------------------------ state
    def state_dict(self) -> StateDict:
        """At a boundary: each server its chunk() of params/ and optim/, and its optimizer's
        step count in ps/optim_step (S,); each worker its clock in ps/clock (W,)."""
        srv = self.ps.server
        if srv is not None:
            s = self.ps.server_ranks.index(self.comm.rank)
            offset = self.ps.shards[s][0]
            tensors = flat_pieces("params", self.layout, srv.params, offset)
            for name, buf in sorted(srv.optimizer.state_buffers().items()):
                tensors.update(flat_pieces(f"optim/{name}", self.layout, buf, offset))
            tensors["ps/optim_step"] = TensorPiece((len(self._optim_steps),), s,
                                                   np.array([srv.optimizer.step_count], np.int64))
        else:
            tensors = {"ps/clock": TensorPiece((self.data_size,), self.data_rank,
                                               np.array([self.worker.clock], np.int64))}
        # rank 0's scalars are kept: the first server's step count (a worker is rank 0)
        return StateDict(self.step, tensors, {"optim_step": self._optim_steps[0],
                                              "optim": self.config["optim"]["name"]})

    def load_state_dict(self, source) -> None:
        """Collective: servers read their chunk() of params/ and optim/ (any writer's
        layout), workers the whole parameters; the clocks when W is unchanged (else every
        worker at the step), then the windows restart from there."""
        step, W, S = int(source.step), self.data_size, len(self.ps.server_ranks)
        keys = set(source.keys())
        error, shard = None, None
        try:
            read_params(source, self.layout, self.params.data)
            srv = self.ps.server
            clocks = np.full(W, step, np.int64)
            if "ps/clock" in keys and tuple(source.shape("ps/clock")) == (W,):
                clocks = np.asarray(source.read("ps/clock", 0, W), np.int64)
            steps = np.full(S, int(source.scalars.get("optim_step", step)), np.int64)
            if "ps/optim_step" in keys and tuple(source.shape("ps/optim_step")) == (S,):
                steps = np.asarray(source.read("ps/optim_step", 0, S), np.int64)
            if srv is not None:
                s = self.ps.server_ranks.index(self.comm.rank)
                offset, count = self.ps.shards[s]
                shard = self.params.data[offset:offset + count]
                for name, buf in srv.optimizer.state_buffers().items():
                    read_flat(source, f"optim/{name}", self.layout, buf, offset)
                srv.optimizer.step_count = int(steps[s])
        except (KeyError, TypeError, ValueError) as exc:
            error = exc
        self.comm.raise_if_any(error)
        self.ps.restore(clocks, step, shard)
        self.step = self._segment_start = step
        self._optim_steps = [int(v) for v in steps]
        self._finished = step >= self.total_steps

    def memory_report(self) -> dict:
        rep = {"params": int(self.params.data.nbytes), "grads": int(self.grads.data.nbytes),
               "optim": 0}
        if self.ps.server is not None:
            opt = self.ps.server.optimizer
            rep["optim"] = sum(int(b.nbytes) for b in opt.state_buffers().values())
        rep["total"] = sum(rep.values())
        return rep

    def close(self) -> None:
        """Collective: free the windows; rank 0 logs the staleness histogram and writes it
        to <out_dir>/ps_stats.json."""
        self.ps.close()
        stats = self.report()
        if self.comm.rank == 0:
            log.info("parameter server %s: %d workers, %d servers, max SSP clock gap %d, "
                     "worker wait %s s; staleness of %d pushes:\n%s", stats["consistency"],
                     stats["workers"], stats["servers"], stats["max_clock_gap"],
                     [round(w, 3) for w in stats["wait_time"]],
                     int(stats["staleness_histogram"].sum()), stats["histogram_text"])
            out = self.config["job"]["out_dir"]
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "ps_stats.json"), "w") as fh:
                json.dump({**stats, "staleness_histogram": stats["staleness_histogram"].tolist()},
                          fh, indent=1)
