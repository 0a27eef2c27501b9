"""`strategy = "ps"`: training through the parameter server (consistency, servers,
staleness, straggler, straggler_mode in the job's [parallel] section).

Server ranks (placed by the topology) hold the optimizer of their shard and read no data
(data_rank None); the W workers read rows chunk(B, w, W) of every global batch. A worker's
step: pull (waiting as BSP/SSP demand), forward/backward with the loss scaled by W / B,
push; the servers apply mean-over-workers gradients, so BSP trains exactly like
data-parallel SGD with the same global batch.

Steps count updates, not pushes. Under BSP every worker makes every step. Under ASP/SSP a
worker's step is the servers' count of applied pushes / W (it may stay put for a call while
the servers catch up), so fast workers take over the work of a straggler and every worker
stops once the servers have made the configured number of steps' worth of updates.

Evaluation: while a worker is still training it evaluates its own rows of the test set
with its latest parameters (no synchronisation of asynchronous workers); after its last
step it waits for the final parameters, and the final evaluation is summed over all ranks
(servers contribute nothing), so every rank reports the same figures.
Server ranks train nothing: their first train_step serves the whole run.
"""
from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
from mpidist.engine.config import check_support
from mpidist.engine.strategy import (StateDict, Strategy, build_model_from_config,
                                     build_optimizer_from_config, replicated_pieces)
from mpidist.errors import ConfigError
from mpidist.nn import SoftmaxCrossEntropy, materialize
from mpidist.ps.consistency import Consistency, Straggler, format_histogram
from mpidist.ps.server import ParameterServer

__all__ = ["ParameterServerStrategy"]

log = logging.getLogger("mpidist")


class ParameterServerStrategy(Strategy):
    """[parallel] strategy = "ps": consistency, servers, staleness, straggler, straggler_mode."""
    name = "ps"

    def __init__(self, config: dict, comm, meta: dict, *, timeout: float = 300.0):
        super().__init__(config, comm, meta)
        check_support(config)       # [parallel] compression / accumulation it cannot honour
        p, ck = config["parallel"], config["checkpoint"]
        if ck["interval"] > 0 or ck["resume"]:
            raise ConfigError("[checkpoint] interval/resume: the parameter server's asynchronous "
                              "workers have no common step to checkpoint at; drop them for "
                              "strategy = 'ps'")
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

    # ------------------------------------------------------------------ training
    def train_step(self, x, y, global_count: int | None = None) -> dict:
        try:
            return self._serve() if self.worker is None else self._work(x, y, global_count)
        except Exception:
            self.ps.abort()            # the other ranks' waits fail now, not at their timeout
            raise

    def _work(self, x, y, global_count) -> dict:
        if global_count is None:
            raise ValueError("strategy 'ps' needs global_count (asynchronous workers can not "
                             "agree on it per step)")
        W = self.data_size
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
        if self.step >= self.total_steps:
            self.worker.finish()
            self.worker.pull_final(out=self.params.data)
            self._finished = True
        t3 = time.perf_counter()
        return {"loss": float(loss_sum) / max(len(x), 1), "correct": int(correct), "count": len(x),
                "t_compute": t2 - t1, "t_comm": (t1 - t0) + (t3 - t2), "t_optim": 0.0,
                "pushes": self.pushes}

    def _serve(self) -> dict:
        """A server's first step runs the whole run; it reports no samples of its own."""
        t0 = time.perf_counter()
        stats = self.ps.serve()
        self.step = self.total_steps
        self._finished = True
        return {"loss": 0.0, "correct": 0, "count": 0, "t_compute": 0.0,
                "t_comm": time.perf_counter() - t0 - stats.apply_time, "t_optim": stats.apply_time}

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
        """The final parameters (after training every worker holds them; servers none)."""
        if self.worker is None:
            return StateDict(self.step, {}, {"pushes": 0})
        tensors = replicated_pieces("params", self.layout, self.params.data,
                                    self.data_rank, self.data_size)
        return StateDict(self.step, tensors, {"pushes": self.pushes})

    def load_state_dict(self, source) -> None:
        raise RuntimeError("strategy 'ps' does not resume from checkpoints; train from scratch")

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
