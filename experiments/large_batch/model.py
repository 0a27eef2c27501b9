"""The learning-rate scaling rules, the paper's table, and what counts as stable."""
from __future__ import annotations

import math


OPTIMIZERS = {   # name: (job, base lr, base batch, rule)
    "sgd": ("jobs/large_batch_sgd.toml", 0.05, 32, "linear"),
    "lars": ("jobs/large_batch_lars.toml", 0.05, 32, "linear"),
    "lamb": ("jobs/large_batch_lamb.toml", 0.04, 1024, "sqrt"),
    "adamw": ("jobs/large_batch_adamw.toml", 0.006, 1024, "sqrt"),
}
TABLE_2 = {"sgd": 8192, "lars": 16384, "lamb": 32768, "adamw": 8192}   # Singh (IJFMR 2025), Table 2
STABLE_GAP = 0.02                 # within 2 points of the optimizer's best accuracy


def scaled_lr(opt: str, batch: int) -> float:
    """The job's learning rate scaled from its base batch to `batch` by its rule."""
    _, lr, base, rule = OPTIMIZERS[opt]
    return lr * (batch / base if rule == "linear" else math.sqrt(batch / base))


def largest_stable(rows):
    """Per optimizer: its best accuracy, and the largest batch whose accuracy is within
    STABLE_GAP of the best accuracy reached by any optimizer at the smallest batch."""
    small = min(r["batch"] for r in rows)
    ref = max(r["test_accuracy"] for r in rows if r["batch"] == small)
    out = {}
    for opt in OPTIMIZERS:
        ok = [r["batch"] for r in rows if r["optimizer"] == opt and
              r["test_accuracy"] >= ref - STABLE_GAP and not r["diverged"]]
        out[opt] = max(ok) if ok else None
    return ref, out
