"""The figure: validation loss against wall time (left) and against bytes sent per rank
(right, log scale), one row per cluster shape and link rate."""
from __future__ import annotations

from experiments.diloco.rows import label, shape


def plot(results: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 3.6 * len(results)), squeeze=False)
    for row, res in zip(axes, results):
        dp_final = next(r for r in res["runs"] if r["method"] == "dp")["curve"][-1][3]
        for i, run in enumerate(res["runs"]):
            pts = run["curve"]
            style = "--" if run["method"] == "streaming" else "-"
            color = "k" if run["method"] == "dp" else f"C{i}"
            row[0].plot([p[1] for p in pts], [p[3] for p in pts], style, color=color,
                        label=label(run), lw=1.4)
            later = [p for p in pts if p[2] > 0]
            row[1].plot([p[2] / 1e6 for p in later], [p[3] for p in later], style, color=color,
                        label=label(run), lw=1.4, marker=".", ms=3)
        where = f"{shape(res)} at {res['rate']}"
        for ax, xlabel in ((row[0], "wall seconds (training, evaluation excluded)"),
                           (row[1], "MB sent per rank between groups (log)")):
            ax.axhline(dp_final * 1.03, color="grey", lw=0.8, ls=":",
                       label="data parallel's final loss + 3%")
            ax.set(xlabel=xlabel, ylabel="validation loss (nats/byte)", title=where)
        row[1].set_xscale("log")
        row[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
