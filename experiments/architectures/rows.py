"""The workers' results as the table's rows, each beside the models' predictions."""
from __future__ import annotations

import numpy as np

from experiments import common
from experiments.architectures.model import fit_of, fit_seconds, link_bytes, link_seconds, \
    node_bytes


def busiest(nic_rounds: list) -> tuple[float, float]:
    """(median bytes of the busiest NIC in its busier direction, the same for tx+rx)."""
    one, both = [], []
    for nic in nic_rounds:
        live = [x for x in nic if x is not None]
        one.append(max(max(t, r) for t, r in live))
        both.append(max(t + r for t, r in live))
    return float(np.median(one)), float(np.median(both))


def measured_rows(result: dict, phase: str, rate_Bps: float) -> list[dict]:
    """Phase A or B: one row per variant and worker count, at link rate `rate_Bps`."""
    CostModel = common.costmodel().CostModel
    nbytes = result["n"] * 4
    fit = fit_of(result["model"])
    cm = CostModel.from_json(result["model"])
    out = []
    for c in result["cases"]:
        v, p, s = c["variant"], c["workers"], c["servers"]
        sec = np.array(c["seconds"])
        busy, busy2 = busiest(c["nic"])
        nodes = result["nodes"]
        sb = link_bytes(v, p, nbytes, max(s, 1)) if phase == "A" else \
            node_bytes(v, nodes, result["per_node"], nbytes)
        if phase == "B" and v in ("ring", "native", "p2p"):
            pred_fit = cm.predict(v, nbytes) if v != "p2p" else None
        elif phase == "B":
            pred_fit = cm.predict("hierarchical", nbytes)
        else:
            pred_fit = fit_seconds(fit, v, p, nbytes, max(s, 1))
        label = f"{s} PS" if v == "ps" else v
        out.append({"phase": phase, "variant": label, "workers": p,
                    "nodes": nodes if phase == "B" else c["members"],
                    "ranks_per_node": result["per_node"], "model_MiB": nbytes / 2**20,
                    "step_s": float(np.median(sec)), "step_s_min": float(sec.min()),
                    "step_s_max": float(sec.max()), "busiest_nic_MB": busy / 1e6,
                    "busiest_nic_txrx_MB": busy2 / 1e6,
                    "paper_model_MB": None if sb is None else sb / 1e6,
                    "paper_model_s": None if sb is None else
                    link_seconds(v, p, nbytes, rate_Bps, max(s, 1)) if phase == "A" else
                    sb / rate_Bps,
                    "fit_model_s": pred_fit})
    return out


def overlap_rows(res: dict, workers: int, nbytes: int) -> list[dict]:
    """Phase C: one row per way of running a step."""
    out = []
    for name, ts in res["times"].items():
        ts = np.array(ts)
        out.append({"phase": "C", "variant": f"ring, {name}", "workers": workers,
                    "nodes": workers, "ranks_per_node": 1, "model_MiB": nbytes / 2**20,
                    "step_s": float(np.median(ts)), "step_s_min": float(ts.min()),
                    "step_s_max": float(ts.max()),
                    "compute_s": 0.0 if name == "comm only" else res["compute_s"],  # nominal
                    "layers": res["layers"], "threaded": res["threaded"]})
    return out


def hidden_fractions(res_c: dict) -> list[float]:
    """Per interleaved sample: the share of the shorter of compute and communication that
    the overlapped step hid, (compute + comm - overlapped) / min(compute, comm)."""
    t = {k: np.array(v) for k, v in res_c["times"].items()}
    return list((t["compute only"] + t["comm only"] - t["overlapped"])
                / np.minimum(t["compute only"], t["comm only"]))
