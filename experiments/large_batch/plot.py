"""The figure: final accuracy against the global batch, one line per optimizer."""
from __future__ import annotations

from experiments.large_batch.model import OPTIMIZERS, STABLE_GAP, TABLE_2, largest_stable


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ref, _ = largest_stable(rows)
    for i, opt in enumerate(OPTIMIZERS):
        rs = sorted((r for r in rows if r["optimizer"] == opt), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in rs], [r["test_accuracy"] for r in rs], "o-", color=f"C{i}",
                label=f"{opt} ({OPTIMIZERS[opt][3]} lr scaling); Table 2: stable to "
                      f"{TABLE_2[opt] // 1024}K")
    ax.axhspan(ref - STABLE_GAP, ref, color="k", alpha=0.08, label="stable band")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="global batch size", ylabel="final test accuracy", ylim=(0, 1.02), title=title)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
