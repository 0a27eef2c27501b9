"""The figure: overhead per step, and its reduction beside the bandwidth model."""
from __future__ import annotations

import numpy as np

from experiments.centralized.model import model_reduction
from experiments.centralized.overhead import reduction


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ps = sorted({r["workers"] for r in rows})
    for arch, color in (("1 server (PS, BSP)", "C3"), ("ring allreduce (dp)", "C2")):
        med = [np.median([r["overhead_s_per_step"] for r in rows if r["workers"] == p and
                          r["architecture"] == arch]) for p in ps]
        axes[0].plot(ps, med, "o-", color=color, label=arch)
        for r in rows:
            if r["architecture"] == arch:
                axes[0].plot(r["workers"], r["overhead_s_per_step"], ".", color=color, alpha=0.4)
    axes[0].set(xlabel="workers p", ylabel="communication overhead per step (s)",
                title="communication overhead per step (dots: rounds)")
    red = [reduction(rows, p) for p in ps]
    axes[1].plot(ps, [x * 100 for x in red], "o-", label="measured")
    axes[1].plot(ps, [model_reduction(p) * 100 for p in ps], "--", label="bandwidth model")
    axes[1].axhline(75, color="k", lw=0.8, ls=":", label="Yang (2025): 75%")
    axes[1].set(xlabel="workers p", ylabel="reduction of communication (%)", ylim=(0, 100),
                title="decentralized vs centralized")
    for ax in axes:
        ax.set_xticks(ps)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
