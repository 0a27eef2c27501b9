"""The figure: step time and busiest-link bytes against workers (phase A), one allreduce
over nodes (phase B), each measured beside the paper's model and mpidist's fit."""
from __future__ import annotations

import numpy as np


def plot(rows_a: list[dict], rows_b: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    colors = {"1 PS": "C3", "2 PS": "C1", "p2p": "C0", "ring": "C2"}
    for label, color in colors.items():
        rs = [r for r in rows_a if r["variant"] == label]
        if not rs:
            continue
        p = [r["workers"] for r in rs]
        axes[0].errorbar(p, [r["step_s"] for r in rs],
                         yerr=[[r["step_s"] - r["step_s_min"] for r in rs],
                               [r["step_s_max"] - r["step_s"] for r in rs]],
                         fmt="o-", color=color, label=f"{label} measured", capsize=3)
        axes[0].plot(p, [r["paper_model_s"] for r in rs], "--", color=color, alpha=0.7)
        axes[0].plot(p, [r["fit_model_s"] for r in rs], ":", color=color, alpha=0.9)
        axes[1].plot(p, [r["busiest_nic_MB"] for r in rs], "o-", color=color, label=label)
        axes[1].plot(p, [r["paper_model_MB"] for r in rs], "--", color=color, alpha=0.7)
    axes[0].set(xlabel="workers p (one per node)", ylabel="seconds per synchronous step",
                title="step time: measured (bars: min-max over rounds),\npaper's model --, "
                      "mpidist alpha-beta fit ..")
    axes[1].set(xlabel="workers p", ylabel="MB per step, busiest NIC, busier direction",
                title="bytes on the busiest link: measured, paper's model --")
    for ax in axes[:2]:
        ax.set_xticks(sorted({r["workers"] for r in rows_a}))
        ax.legend(fontsize=7)
    labels = [r["variant"] for r in rows_b]
    x = np.arange(len(rows_b))
    axes[2].bar(x - 0.27, [r["step_s"] for r in rows_b], 0.27, label="measured", color="C0")
    axes[2].bar(x, [r["paper_model_s"] or 0 for r in rows_b], 0.27, label="paper's model",
                color="C7")
    axes[2].bar(x + 0.27, [r["fit_model_s"] or 0 for r in rows_b], 0.27,
                label="mpidist fit", color="C9")
    axes[2].set_xticks(x, labels)
    if rows_b:
        axes[2].set_title(f"{rows_b[0]['nodes']} nodes x {rows_b[0]['ranks_per_node']} ranks: "
                          f"one allreduce", fontsize=10)
    axes[2].set_ylabel("seconds")
    axes[2].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
