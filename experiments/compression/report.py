"""The experiment's section of docs/EXPERIMENTS.md: setup, table and verdict."""
from __future__ import annotations

from experiments import common
from experiments.compression import JOB, NAME, RANKS
from experiments.compression.compressors import WITHIN


def section(rows, args, out, cfg, took, numel) -> str:
    """The section's markdown, its verdict worded from the figures."""
    ref = rows[0]
    tab = ["| compressor | bytes/step per rank | vs float32 ring | MB per rank, run | final "
           "accuracy | vs uncompressed (points) |", "|---|---|---|---|---|---|"]
    for r in rows:
        tab.append(f"| {r['compressor']} | {r['bytes_per_step']:,} | {r['wire_ratio']:.4f} | "
                   f"{r['MB_sent_per_rank']:.2f} | {r['test_accuracy']:.3f} | "
                   f"{(r['test_accuracy'] - ref['test_accuracy']) * 100:+.1f} |")
    keep = [r["compressor"] for r in rows[1:] if r["test_accuracy"] >= ref["test_accuracy"] - WITHIN]
    lose = [r["compressor"] for r in rows[1:] if r["compressor"] not in keep]
    sparse = bool(lose) and all(c.startswith(("topk", "randomk")) for c in lose)
    sparse_note = ("Those below are all sparsifiers: they drop most coordinates every step, and "
                   "error feedback returns the dropped mass later but, in this many epochs, "
                   "not all of the way (random-k, which drops blindly, least). "
                   if sparse else "")
    best = min((r for r in rows[1:] if r["compressor"] in keep), key=lambda r: r["wire_ratio"],
               default=None)
    return f"""## 5. Gradient compression keeps LAMB's accuracy while cutting bytes (Singh, IJFMR 2025)

**Claim.** Gradient compression and quantization work with adaptive optimizers like LAMB,
keeping their accuracy while cutting the bytes communicated (Singh, "Architectural Evolution
in Distributed Training: From Parameter Servers to Zero Redundancy Systems", IJFMR 2025).

**Setup.** The shipped `{JOB}` (MLP 64-256-256-10, {numel:,} parameters, LAMB lr 0.02 with
warm-up and cosine decay, global batch 128, ring allreduce) on {RANKS} local ranks, {cfg['epochs']}
epochs, once uncompressed and once per compressor (`parallel.compression`, error feedback
where the compressor offers it; checkpoints off). Bytes per step: each compressor's
`CompressedAllreduce` on the job's own layout, the busiest rank's exact count (the payload
through its default combine: allgather for top-k, sign, QSGD; ring for fp16/bf16;
linear for random-k and PowerSGD). Accuracy is the final test accuracy; the runs are
deterministic, so the table does not move between reruns at the same rank count (the
training times in the CSV do; they were taken on a shared 2-core VM: {common.machine()}).

**Command.** `{common.command_line(NAME, args)}` ({took:.0f} s).

![compression]({out.figure_link()})

{chr(10).join(tab)}

**Verdict.** Within {WITHIN * 100:.0f} point of uncompressed LAMB ({ref['test_accuracy']:.3f}):
{', '.join(keep) or 'none'}; below it: {', '.join(lose) or 'none'}.
{f"The cheapest that keeps the accuracy is {best['compressor']} at {best['wire_ratio']:.3f} of the float32 ring's bytes." if best else ''}
So the claim holds for {len(keep)} of {len(rows) - 1} compressors on this job (all with
error feedback, built in or switched on). {sparse_note}The
allgather-combined compressors (top-k, sign, QSGD) send p-1 payloads per rank against the
ring's 2(p-1)/p model sizes, so their ratio to the ring is p/2 times their payload ratio
({RANKS // 2}x at {RANKS} ranks) and grows with the rank count. The paper gives no figure
to compare against, only the qualitative statement.
"""
