"""Data parallelism: every rank holds the whole model, reads its rows of the global batch, and
the DistributedOptimizer sums gradients across ranks while backward runs."""
from __future__ import annotations

import time

import numpy as np

from mpidist.engine.distributed import DistributedOptimizer
from mpidist.kernels.backend import cupy
from mpidist.nn import SoftmaxCrossEntropy, materialize
from mpidist.partition import chunk
from mpidist.state import StateDict, read_flat, read_params, replicated_pieces
from mpidist.strategy.base import Strategy
from mpidist.strategy.builders import build_compression, build_model_from_config, build_optimizer_from_config
from mpidist.strategy.compression_state import compression_pieces, compression_scalars, restore_compression

__all__ = ["DataParallel"]


class DataParallel(Strategy):
    """[parallel] strategy = "dp": algorithm, bucket_mb, compression (compression_options,
    compression_warmup, compression_allreduce), accumulation.

    The loss is summed over samples and scaled by 1 / (global batch), and gradients are summed
    across ranks: the result is the gradient of the global mean loss whatever the split, so
    p ranks train exactly like one rank with the same global batch (up to summation order).
    accumulation = k splits this rank's rows into k micro-batches, sending only after the last.
    """
    name = "dp"

    def __init__(self, config: dict, comm, meta: dict):
        super().__init__(config, comm, meta)
        p = config["parallel"]
        self.model = build_model_from_config(config, meta).no_input_grad()
        self.xp = np
        if config["job"]["device"] == "gpu":
            self.xp = cupy()
            comm.use_gpu()
        self.layout, self.params, self.grads = materialize(self.model, dtype=np.float32, xp=self.xp,
                                                           seed=config["job"]["seed"])
        self.optimizer = build_optimizer_from_config(config, self.layout)
        self.dopt = DistributedOptimizer(self.optimizer, self.params, self.grads, comm=comm,
                                         algorithm=p["algorithm"], bucket_mb=p["bucket_mb"],
                                         accumulation=p["accumulation"], op="sum",
                                         compression=build_compression(config, comm))
        self.dopt.attach(self.model)
        self.loss = SoftmaxCrossEntropy()
        self.tokens = int(meta["block"]) if meta.get("kind") == "lm" else 1

    def train_step(self, x, y, global_count: int | None = None) -> dict:
        rows = 0 if x is None else len(x)
        if rows:
            x, y = self.xp.asarray(x), self.xp.asarray(y)
        if global_count is None:
            global_count = self.comm.comm.allreduce(rows)
        scale = 1.0 / (global_count * self.tokens)
        k = self.dopt.accumulation
        t0 = time.perf_counter()
        loss_sum = correct = 0.0
        for i in range(k):
            lo, n = chunk(rows, i, k)
            logits = self.model.forward(x[lo:lo + n], train=True)
            l, c = self.loss.forward(logits, y[lo:lo + n])
            loss_sum, correct = loss_sum + l, correct + c
            self.model.backward(self.loss.backward(scale))
            if i < k - 1:
                self.dopt.step()
        t_fwd_bwd = time.perf_counter() - t0
        info = self.dopt.step(stats=[loss_sum, correct, rows * self.tokens])
        self.step += 1
        total_loss, total_correct, count = info["stats"]
        return {"loss": total_loss / max(count, 1), "correct": int(total_correct), "count": int(count),
                "t_compute": t_fwd_bwd - info["t_launch"], "t_comm": info["t_launch"] + info["t_wait"],
                "t_optim": info["t_optim"], "skipped": info["skipped"], "lr": info.get("lr", float("nan"))}

    def evaluate(self, x, y) -> dict:
        loss_sum = correct = 0.0
        count = 0 if x is None else len(x) * self.tokens
        if count:
            logits = self.model.forward(self.xp.asarray(x), train=False)
            loss_sum, correct = self.loss.forward(logits, self.xp.asarray(y))
        totals = self.comm.comm.allreduce(np.array([loss_sum, correct, count], dtype=np.float64))
        return {"loss": float(totals[0]), "correct": int(totals[1]), "count": int(totals[2])}

    def predict(self, x):
        """Logits of this rank's inputs (no communication)."""
        return self.model.forward(self.xp.asarray(x), train=False)

    def state_dict(self) -> StateDict:
        r, s = self.comm.rank, self.comm.size
        sd = self._replicated(r, s)
        ca = self.dopt.compressed
        if ca is not None:          # this rank's residuals: one row per rank
            sd.tensors.update(compression_pieces(ca, self.layout, r, s))
            sd.scalars["compression"] = compression_scalars(ca)
        if self.dopt.onebit is not None:     # the 1-bit momentum exchange's residuals
            sd.tensors.update(self.dopt.onebit.pieces(r, s))
            sd.scalars.update(self.dopt.onebit.scalars())
        return sd

    def replica_state_dict(self) -> StateDict:
        """Every rank holds the whole model and optimizer: all of it, as rank 0 of 1 (without
        the per-rank residuals of compression, which start afresh where this is loaded)."""
        return self._replicated(0, 1)

    def _replicated(self, r: int, s: int) -> StateDict:
        """What every rank holds whole (parameters, optimizer buffers and scalars) as rank r
        of s writes it: chunk(r, s) of each."""
        tensors = replicated_pieces("params", self.layout, self.params.data, r, s)
        for name, buf in sorted(self.optimizer.state_buffers().items()):
            tensors.update(replicated_pieces(f"optim/{name}", self.layout, buf, r, s))
        scalars = {"optim_step": self.optimizer.step_count, "optim": self.optimizer.name,
                   "optim_extra": self.optimizer.extra_state()}
        return StateDict(self.step, tensors, scalars)

    def load_state_dict(self, source) -> None:
        read_params(source, self.layout, self.params.data)
        for name, buf in self.optimizer.state_buffers().items():
            read_flat(source, f"optim/{name}", self.layout, buf)
        self.optimizer.step_count = int(source.scalars.get("optim_step", source.step))
        if "optim_extra" in source.scalars:
            self.optimizer.load_extra_state(source.scalars["optim_extra"])
        if self.dopt.compressed is not None:
            restore_compression(self.dopt.compressed, source, self.layout,
                                [(lo, hi - lo) for lo, hi in self.dopt.buckets], self.comm.rank, self.comm.size)
        if self.dopt.onebit is not None:
            self.dopt.onebit.restore(source, [(0, self.layout.numel)], self.comm.rank, self.comm.size)
        self.step = int(source.step)
        self.dopt.zero_grad()

    def memory_report(self) -> dict:
        optim = sum(int(b.nbytes) for b in self.optimizer.state_buffers().values())
        rep = {"params": int(self.params.data.nbytes), "grads": int(self.grads.data.nbytes), "optim": optim}
        rep["total"] = sum(rep.values())
        return rep
