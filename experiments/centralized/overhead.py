"""Communication overhead per step, and how much of it the ring saves."""
from __future__ import annotations

import numpy as np


def overheads(rows: list[dict]) -> list[dict]:
    """Communication overhead per step = wall time per step - a worker's compute and
    optimizer time per step, the latter from the ring run of the same round and p (rank 0
    of the parameter-server job is a server, whose metrics hold no worker compute; a PS
    worker computes the same forward/backward on the same rows)."""
    for r in rows:
        twin = next(x for x in rows if x["round"] == r["round"] and x["workers"] == r["workers"]
                    and x["compute_s_per_step"] is not None)
        r["overhead_s_per_step"] = max(r["wall_s_per_step"] - twin["compute_s_per_step"], 0.0)
    return rows


def reduction(rows, p):
    """1 - the ring's overhead / one server's, medians over rounds, at p workers."""
    get = lambda a: np.median([r["overhead_s_per_step"] for r in rows if r["workers"] == p and
                               r["architecture"] == a])
    return 1 - get("ring allreduce (dp)") / get("1 server (PS, BSP)")
