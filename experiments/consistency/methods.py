"""The methods compared, the straggler kinds, and the overrides of each run."""
from __future__ import annotations

import os


METHODS = {   # label: (job, ranks, overrides)
    "sync SGD (PS, BSP)": ("jobs/digits_ps_bsp.toml", 4, {}),
    "async SGD (PS, ASP)": ("jobs/digits_ps_asp.toml", 4, {}),
    "bounded staleness (PS, SSP 2)": ("jobs/digits_ps_ssp.toml", 4, {}),
    "ADMM (3 ranks)": ("jobs/digits_admm.toml", 3, {"data.batch_size": 48}),
}
TARGET = 0.90                     # time-to-accuracy threshold on the test rows
KINDS = ("none", "fixed", "random")


def overrides(label, kind, cfg, tmp) -> dict:
    """The `--set` overrides of one run: the method's own, epochs, and the straggler."""
    job, _, over = METHODS[label]
    over = {**over, "job.epochs": cfg["epochs"], "job.eval_every": cfg["eval_every"],
            "job.target_accuracy": 0.0, "data.cache_dir": os.path.join(tmp, "data")}
    if "ps" in job:
        over.update({"parallel.straggler": cfg["delay"] if kind != "none" else 0.0,
                     "parallel.straggler_mode": "fixed" if kind == "none" else kind})
    return over
