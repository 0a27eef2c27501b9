"""A run's metrics as a table row, with its accuracy-against-wall-time curve."""
from __future__ import annotations

from experiments.consistency.methods import TARGET


def curve(records) -> tuple[list, list]:
    """(wall seconds, test accuracy) at each evaluation, time summed over rank 0's steps."""
    t, times, accs = 0.0, [], []
    for r in records:
        if r.get("event") == "step":
            t += r["t_step"]
        elif r.get("event") == "eval":
            times.append(t)
            accs.append(r["accuracy"])
    return times, accs


def row(label, kind, cfg, summary, records) -> dict:
    """One run as a table row (the curve kept for the plot, left out of the CSV)."""
    times, accs = curve(records)
    hit = next((t for t, a in zip(times, accs) if a >= TARGET), None)
    return {"method": label, "straggler": kind,
            "straggler_s": cfg["delay"] if kind != "none" else 0.0,
            "final_accuracy": summary["test_accuracy"], "final_loss": summary["test_loss"],
            "wall_s": times[-1] if times else summary["train_seconds"],
            "time_to_target_s": hit, "steps": summary["steps"],
            "curve_t": times, "curve_acc": accs}
