"""The figure: accuracy against wall time, one panel per straggler kind."""
from __future__ import annotations

from experiments.consistency.methods import KINDS, METHODS, TARGET


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kinds = [k for k in KINDS if any(r["straggler"] == k for r in rows)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.4), sharey=True)
    for ax, kind in zip(axes, kinds):
        for i, label in enumerate(METHODS):
            rs = [r for r in rows if r["method"] == label and r["straggler"] == kind]
            for j, r in enumerate(rs):
                ax.plot(r["curve_t"], r["curve_acc"], "-", color=f"C{i}", alpha=0.9 if j == 0 else 0.4,
                        label=label if j == 0 else None)
        ax.axhline(TARGET, color="k", lw=0.7, ls=":")
        delay = max((r["straggler_s"] for r in rows), default=0)
        ax.set(xlabel="wall time, rank 0 (s)", ylim=(0, 1),
               title={"none": "no straggler",
                      "fixed": f"persistent straggler: last worker +{delay * 1e3:.0f} ms/step",
                      "random": f"transient: a random worker +{delay * 1e3:.0f} ms/step"}[kind])
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("test accuracy")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
