"""One `mpidist train` job on the simulated cluster, centralized or not, and what it
measured: wall time, a worker's compute, the busiest NIC's bytes, accuracy."""
from __future__ import annotations

import os

import numpy as np

from experiments import common
from experiments.centralized import JOB


def train_once(cluster, p: int, central: bool, cfg: dict, tmp: str, rnd: int) -> dict:
    """Train the job on p workers (plus a server node when `central`) in round `rnd`."""
    over = {"job.steps": cfg["steps"], "job.eval_every": 0, "model.hidden": cfg["hidden"],
            "data.features": cfg["features"], "data.samples": cfg["samples"],
            "data.batch_size": cfg["batch"], "data.cache_dir": os.path.join(tmp, "data"),
            "optim.lr": 0.05}
    if central:
        over.update({"parallel.strategy": "ps", "parallel.consistency": "bsp",
                     "parallel.servers": 1})
    else:
        over.update({"parallel.strategy": "dp", "parallel.algorithm": "ring",
                     "parallel.bucket_mb": 0.0})
    n = p + 1 if central else p
    before = cluster.nic_counters()
    out = os.path.join(tmp, f"{'ps' if central else 'ring'}-p{p}-r{rnd}")
    summary, records = common.mpidist_train(n, JOB, over, out, timeout=900, cluster=cluster,
                                            thread_level="serialized")
    after = cluster.nic_counters()
    steps = [r for r in records if r.get("event") == "step"]
    sent = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
    work = steps[1:] or steps
    return {"architecture": "1 server (PS, BSP)" if central else "ring allreduce (dp)",
            "workers": p, "nodes": n, "round": rnd,
            "wall_s_per_step": (summary["train_seconds"] - _jit(steps)) / summary["steps"],
            "compute_s_per_step": None if central else
            float(np.median([r["t_compute"] + r["t_optim"] for r in work])),
            "busiest_nic_MB_per_step": max(max(t, r) for t, r in sent) / summary["steps"] / 1e6,
            "test_accuracy": summary["test_accuracy"], "train_s": summary["train_seconds"]}


def _jit(steps: list[dict]) -> float:
    """The first step's optimizer time beyond the others' median: Numba compiling (or
    loading) its kernels inside the data-parallel loop; the parameter server compiles
    before its loop, so this alone is taken out of the data-parallel wall time."""
    if len(steps) < 2 or steps[0]["t_compute"] == 0.0 and steps[0]["t_optim"] == 0.0:
        return 0.0
    return max(steps[0]["t_optim"] - float(np.median([r["t_optim"] for r in steps[1:]])), 0.0)
