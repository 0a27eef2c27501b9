"""Each run's overrides, and its metrics as a table row."""
from __future__ import annotations

import os

import numpy as np

from experiments.large_batch.model import scaled_lr


def overrides(opt, batch, cfg, tmp) -> dict:
    """The `--set` overrides of one run: the task, the batch, its learning rate, warm-up."""
    n_train = int(cfg["samples"] * 0.8)
    steps = cfg["epochs"] * (n_train // batch)
    return {"job.epochs": cfg["epochs"], "job.target_accuracy": 0.0, "job.eval_every": 0,
            "data.dataset": "synthetic", "data.samples": cfg["samples"],
            "data.features": cfg["features"], "data.classes": cfg["classes"],
            "data.batch_size": batch, "data.test_fraction": 0.2,
            "data.cache_dir": os.path.join(tmp, "data"), "model.hidden": cfg["hidden"],
            "optim.lr": scaled_lr(opt, batch), "optim.warmup_steps": max(1, steps // 10),
            "parallel.algorithm": "ring"}


def row(opt, batch, over, summary, records) -> dict:
    """One run as a table row; diverged when its loss left the finite numbers."""
    losses = [r["loss"] for r in records if r.get("event") == "step"]
    return {"optimizer": opt, "batch": batch, "lr": over["optim.lr"], "steps": summary["steps"],
            "test_accuracy": summary["test_accuracy"], "test_loss": summary["test_loss"],
            "diverged": bool(not np.isfinite(summary["test_loss"]) or
                             not all(np.isfinite(losses))),
            "train_s": summary["train_seconds"]}
