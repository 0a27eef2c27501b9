"""The end-of-run figure: loss, accuracy, step-time breakdown and throughput (matplotlib Agg)."""
from __future__ import annotations

import numpy as np

from mpidist.strategy.metrics import read_metrics

__all__ = ["plot_run"]


def plot_run(metrics_path: str, png_path: str, title: str = "") -> str:
    """Draw the run's metrics.jsonl into png_path (rank 0, at the end); returns png_path."""
    import matplotlib   # deferred: heavy, and needed once per run, on rank 0
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("event") == "step"]
    evals = [r for r in rows if r.get("event") == "eval"]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    steps = np.array([r["step"] for r in train])
    if len(train):
        ax[0, 0].plot(steps, [r["loss"] for r in train], lw=0.8, label="train (batch)")
        ax[0, 1].plot(steps, [r["accuracy"] for r in train], lw=0.8, alpha=0.6, label="train (batch)")
        keys = [("t_compute", "compute"), ("t_comm", "communication (exposed)"), ("t_optim", "optimizer"),
                ("t_data", "data")]
        warm = train[1:] if len(train) > 1 else train        # the first step compiles kernels
        wsteps = steps[len(train) - len(warm):]
        bottom = np.zeros(len(warm))
        for k, label in keys:
            v = np.array([r.get(k) or 0.0 for r in warm]) * 1e3
            ax[1, 0].fill_between(wsteps, bottom, bottom + v, step="mid", label=label, alpha=0.8)
            bottom += v
        ax[1, 0].set_ylim(0, max(1e-3, float(np.percentile(bottom, 98)) * 1.3))
        rate = np.array([r["samples_per_s"] for r in train])
        ax[1, 1].plot(steps, rate, lw=0.6, alpha=0.5, label="per step")
        k = max(1, len(rate) // 20)
        if len(rate) > k:
            smooth = np.convolve(rate, np.ones(k) / k, mode="valid")
            ax[1, 1].plot(steps[k - 1:], smooth, lw=1.5, label=f"mean of {k}")
        ax[1, 1].legend(fontsize=8)
    if evals:
        ax[0, 0].plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="test")
        ax[0, 1].plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", label="test")
    ax[0, 0].set(title="loss", xlabel="step", yscale="log")
    ax[0, 1].set(title="accuracy", xlabel="step", ylim=(0, 1.02))
    ax[1, 0].set(title="step time breakdown (rank 0; from step 2)", xlabel="step", ylabel="ms")
    ax[1, 1].set(title="throughput", xlabel="step", ylabel="samples/s")
    for a in (ax[0, 0], ax[0, 1], ax[1, 0]):
        a.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
