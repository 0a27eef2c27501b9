"""The workers' results as rows: every curve point (the CSV), and one summary per run with
the figures the verdict compares (final loss, seconds, bytes, and when each run first got
within 3% of data parallel's final loss and stayed there)."""
from __future__ import annotations

WITHIN = 1.03          # "DP's final validation loss within 3%"


def label(run: dict) -> str:
    if run["method"] == "dp":
        return "data parallel"
    if run["method"] == "streaming":
        return f"streaming DiLoCo H={run['H']} ({run['fragments']} fragments)"
    return f"DiLoCo H={run['H']}"


def shape(res: dict) -> str:
    return f"{res['nodes']}x{res['per_node']}"


def curve_rows(results: list[dict]) -> list[dict]:
    rows = []
    for res in results:
        for run in res["runs"]:
            for step, seconds, sent, loss in run["curve"]:
                rows.append({"cluster": shape(res), "rate": res["rate"], "method": label(run),
                             "H": run["H"], "fragments": run["fragments"], "step": step,
                             "seconds": seconds, "bytes_per_rank": sent, "val_loss": loss})
    return rows


def _first_within(curve, target: float):
    """(seconds, bytes) at the first evaluation from which the loss stays within 3% of
    target to the end of the budget (a run that dips in mid-round and ends above does not
    count as having reached it)."""
    hit = None, None
    for step, seconds, sent, loss in reversed(curve):
        if step == 0 or loss > target * WITHIN:
            break
        hit = seconds, sent
    return hit


def summary_rows(results: list[dict]) -> list[dict]:
    rows = []
    for res in results:
        dp = next(r for r in res["runs"] if r["method"] == "dp")
        dp_loss, dp_seconds = dp["curve"][-1][3], dp["seconds"]
        for run in res["runs"]:
            t_hit, b_hit = _first_within(run["curve"], dp_loss)
            loss = run["curve"][-1][3]
            best = min(run["curve"][1:], key=lambda p: p[3])
            nic = max((max(n) for n in run["nic"]), default=0)
            rows.append({
                "cluster": shape(res), "rate": res["rate"], "method": label(run),
                "final_val_loss": loss, "vs_dp_loss": loss / dp_loss,
                "best_val_loss": best[3], "best_step": best[0],
                "seconds": run["seconds"], "vs_dp_time": run["seconds"] / dp_seconds,
                "MB_per_rank": run["bytes_per_rank"] / 1e6,
                "fewer_bytes": (dp["bytes_per_rank"] / run["bytes_per_rank"]
                                if run["bytes_per_rank"] else float("inf")),
                "nic_MB_busiest": nic / 1e6,
                "within3_seconds": t_hit, "within3_MB": None if b_hit is None else b_hit / 1e6,
                "within3_vs_dp_time": None if t_hit is None else t_hit / dp_seconds})
    return rows
