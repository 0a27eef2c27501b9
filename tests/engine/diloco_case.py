"""The small job the DiLoCo tests share: an MLP on synthetic data, its configs (one built
for stepping a strategy by hand, one for the whole loop with checkpoints) and batches."""
import os

import numpy as np

from mpidist.engine.config import validate

FEATURES, CLASSES, BATCH = 12, 4, 20
META = {"kind": "classification", "in_shape": (FEATURES,), "classes": CLASSES}
ADAMW = {"name": "adamw", "lr": 0.01, "hyper": {"weight_decay": 0.01}}


def config(strategy: str, optim: dict, steps: int, **parallel) -> dict:
    """A validated config for build_strategy, total_steps filled in as the loop does."""
    cfg = validate({"job": {"steps": steps, "progress": False, "plot": False, "seed": 3},
                    "model": {"name": "mlp", "hidden": [16]},
                    "data": {"dataset": "synthetic", "features": FEATURES, "classes": CLASSES},
                    "optim": optim, "parallel": {"strategy": strategy, "algorithm": "ring", **parallel}},
                   name=strategy)
    cfg["job"]["total_steps"] = steps
    return cfg


def batches(steps: int):
    """The same global batches on every rank."""
    rng = np.random.default_rng(11)
    return [(rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
             rng.integers(0, CLASSES, BATCH)) for _ in range(steps)]


def loop_config(shared_dir, name, resume, *, strategy="diloco", steps=11, interval=6, **parallel) -> dict:
    """A config for engine.loop.run: 300 samples, batches of 20, AdamW inside groups of 2,
    H = 4, checkpoints every `interval` steps (0: at the end) in <shared_dir>/ckpt."""
    return validate({"job": {"steps": steps, "eval_every": 0, "progress": False, "plot": False, "seed": 4,
                             "out_dir": os.path.join(shared_dir, name)},
                     "model": {"name": "mlp", "hidden": [16]},
                     "data": {"dataset": "synthetic", "samples": 300, "features": FEATURES,
                              "classes": CLASSES, "batch_size": BATCH,
                              "cache_dir": os.path.join(shared_dir, "data")},
                     "optim": ADAMW,
                     "parallel": {"strategy": strategy, "algorithm": "ring", "group_size": 2,
                                  "sync_every": 4, **parallel},
                     "checkpoint": {"interval": interval, "dir": os.path.join(shared_dir, "ckpt"),
                                    "resume": resume}}, name=name)
