"""The figure: accuracy against bytes sent, final and as the bytes accumulate."""
from __future__ import annotations

from experiments.compression.compressors import WITHIN


def plot(rows, curves, path, title):
    """Write the figure; `curves` maps a compressor to its (steps, accuracies)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ref = rows[0]
    for i, r in enumerate(rows):
        axes[0].scatter(r["MB_sent_per_rank"], r["test_accuracy"], color=f"C{i}", s=40, zorder=3)
        axes[0].annotate(r["compressor"], (r["MB_sent_per_rank"], r["test_accuracy"]),
                         fontsize=7, xytext=(4, 3), textcoords="offset points")
        steps, accs = curves[r["compressor"]]
        mb = [s * r["bytes_per_step"] / 1e6 for s in steps]
        axes[1].plot(mb, accs, "-", color=f"C{i}", label=r["compressor"])
    axes[0].axhspan(ref["test_accuracy"] - WITHIN, ref["test_accuracy"], color="k", alpha=0.08,
                    label=f"within {WITHIN * 100:.0f} point of uncompressed")
    axes[0].set(xscale="log", xlabel="MB sent per rank, whole run (log)",
                ylabel="final test accuracy", title="bytes against accuracy")
    axes[0].legend(fontsize=7, loc="lower right")
    axes[1].set(xscale="log", xlabel="MB sent per rank so far (log)", ylabel="test accuracy",
                title="accuracy as the bytes accumulate")
    axes[1].legend(fontsize=6, loc="lower right")
    from matplotlib.ticker import NullFormatter
    for ax in axes:
        ax.xaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
