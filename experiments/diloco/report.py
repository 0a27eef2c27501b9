"""The section of docs/EXPERIMENTS.md: the summary table and the verdict, written from the
measured rows alone."""
from __future__ import annotations

from experiments import common
from experiments.diloco import NAME


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(summary: list[dict]) -> str:
    lines = ["| cluster | link | method | final val loss | / DP | train s | / DP | MB per rank "
             "| DP / this bytes | busiest NIC MB | s to DP loss +3% | / DP's s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['cluster']} | {r['rate']} | {r['method']} | {r['final_val_loss']:.3f} "
                     f"| {r['vs_dp_loss']:.3f} | {r['seconds']:.1f} | {r['vs_dp_time']:.2f} "
                     f"| {r['MB_per_rank']:.1f} | {r['fewer_bytes']:.0f}x | {r['nic_MB_busiest']:.1f} "
                     f"| {_f(r['within3_seconds'], '.1f')} | {_f(r['within3_vs_dp_time'], '.2f')} |")
    return "\n".join(lines)


def passes(r: dict) -> bool:
    """The claim tested (DiLoCo, Douillard et al. 2023): DP's final loss within 3%, in <= 1/4 of DP's time, >= 50x fewer bytes."""
    return (r["method"] != "data parallel" and r["within3_vs_dp_time"] is not None
            and r["within3_vs_dp_time"] <= 0.25 and r["fewer_bytes"] >= 50)


def verdict(summary: list[dict]) -> str:
    out = []
    for cluster in dict.fromkeys(r["cluster"] for r in summary):
        slow = [r for r in summary if r["cluster"] == cluster and r["rate"] == "100mbit"]
        ok = [r["method"] for r in slow if passes(r)]
        out.append(f"- {cluster} at 100 Mbit/s: " + (
            f"**met** by {', '.join(ok)}." if ok else
            "**not met** by any DiLoCo variant."))
        for r in summary:
            if r["cluster"] == cluster and r["method"] != "data parallel" and not passes(r):
                out.append(f"  - {r['rate']}, {r['method']}: {_fails(r)}")
    return "\n".join(out)


def _fails(r: dict) -> str:
    """Which parts of the bar a run misses, in words."""
    parts = []
    if r["within3_vs_dp_time"] is None:
        parts.append(f"never within 3% of data parallel's final loss (ends "
                     f"{100 * (r['vs_dp_loss'] - 1):+.1f}%)")
    elif r["within3_vs_dp_time"] > 0.25:
        parts.append(f"within 3% only after {r['within3_vs_dp_time']:.2f} of DP's time")
    if r["fewer_bytes"] < 50:
        parts.append(f"only {r['fewer_bytes']:.0f}x fewer bytes")
    if r["vs_dp_time"] >= 1:
        parts.append(f"slower than DP over the whole budget ({r['vs_dp_time']:.2f}x)")
    return "; ".join(parts) or "meets the loss, time and bytes parts"


def section(summary: list[dict], args, out, cfg: dict) -> str:
    hs = ", ".join(str(h) for h in cfg["H"])
    return f"""## 6. DiLoCo matches data parallel with far fewer bytes on slow links (Douillard et al., arXiv 2311.08105)

**Claim.** DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models", 2023): groups that run H inner AdamW steps and then average their
parameter deltas with an outer Nesterov step (lr {cfg['outer_lr']}, momentum
{cfg['outer_momentum']}) match synchronous data parallel training while sending about H times
fewer bytes; Streaming DiLoCo (arXiv 2501.18512) sends the model in fragments on staggered
schedules. The bar: at 100 Mbit/s DiLoCo reaches data parallel's final validation loss
within 3% in at most 1/4 of its wall time with at least 50x fewer bytes.

**Setup.** The byte-level GPT of jobs/torch_gpt.py made smaller ({cfg['layers']} layers, dim
{cfg['dim']}, {cfg['heads']} heads, block {cfg['block']}) on data/sample.txt, the last 10%
held out ({cfg['eval_windows']} evenly spaced windows). Every variant trains for the same
token budget: {cfg['steps']} inner steps per rank of {cfg['batch']} windows of {cfg['block']}
bytes, AdamW lr {cfg['lr']}, weight decay 0.01, from the same initial weights and windows.
Data parallel: `mpidist.torch.DistributedOptimizer` over all ranks. DiLoCo: the same AdamW
within a group (one group per node), `mpidist.torch.DiLoCo` at H = {hs}, and streaming at
H = {cfg['stream_H']} with {cfg['fragments']} fragments. The paper's H = 25, 100, 500 are
scaled down to these (its budgets are hundreds of times longer than the {cfg['steps']} steps that fit
here): {", ".join(str(cfg['steps'] // h) for h in cfg['H'])} outer steps per run. Bytes per
rank as follows: data parallel 2(n-1)/n x 4 x params per step, DiLoCo what
its outer allreduce reports; the busiest simulated NIC's counter (MB, larger direction) is
beside them. Wall time is training alone (the validation passes are excluded); the
"s to DP loss +3%" column is the first evaluation (every {cfg['eval_every']} steps) within 3%
of data parallel's final loss. Machine: {common.machine()}; the whole run took
{cfg['took']:.0f} s.

**Command.** `{common.command_line(NAME, args)}` (CSV: `{'docs/experiments/diloco.csv' if out.full else out.csv}`,
one row per evaluation of every run).

![DiLoCo vs data parallel]({out.figure_link()})

{table(summary)}

**Verdict.**
{verdict(summary)}
"""
