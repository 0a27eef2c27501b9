"""The section of docs/EXPERIMENTS.md: the summary table and the verdict, written from the
measured rows alone."""
from __future__ import annotations

import os

from experiments import common
from experiments.diloco import NAME, SHAPES


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
    """Per cluster shape: is the bar met at 100 Mbit/s, and by which variants; then every
    DiLoCo run at either rate with what it meets or misses."""
    out = []
    for cluster in dict.fromkeys(r["cluster"] for r in summary):
        slow = [r for r in summary if r["cluster"] == cluster and r["rate"] == "100mbit"]
        ok = [r["method"] for r in slow if passes(r)]
        out.append(f"- {cluster} at 100 Mbit/s: " + (
            f"**met** by {', '.join(ok)}." if ok else
            "**not met** by any DiLoCo variant."))
        for r in summary:
            if r["cluster"] == cluster and r["method"] != "data parallel":
                out.append(f"  - {r['rate']}, {r['method']}: "
                           + (_meets(r) if passes(r) else _fails(r)))
    return "\n".join(out)


def _meets(r: dict) -> str:
    return (f"within 3% of data parallel's final loss after {r['within3_vs_dp_time']:.2f} of "
            f"its time, {r['fewer_bytes']:.0f}x fewer bytes (ends {_pct(r)})")


def _pct(r: dict) -> str:
    return f"{100 * (r['vs_dp_loss'] - 1):+.1f}% against data parallel"


def _fails(r: dict) -> str:
    """Which parts of the bar a run misses, in words."""
    parts = []
    if r["within3_vs_dp_time"] is None:
        parts.append(f"never within 3% of data parallel's final loss (ends {_pct(r)})")
    elif r["within3_vs_dp_time"] > 0.25:
        parts.append(f"within 3% only after {r['within3_vs_dp_time']:.2f} of DP's time "
                     f"(ends {_pct(r)})")
    if r["fewer_bytes"] < 50:
        parts.append(f"only {r['fewer_bytes']:.0f}x fewer bytes")
    if r["vs_dp_time"] >= 1:
        parts.append(f"slower than DP over the whole budget ({r['vs_dp_time']:.2f}x)")
    return "; ".join(parts) or "meets the loss, time and bytes parts"


def losses(summary: list[dict], cfg: dict) -> str:
    """Where DiLoCo loses, in measured figures: the H that leaves the fewest outer steps in
    the budget, the fast link, and data parallel's own cost of the slow link."""
    out = []
    few = max(cfg["H"])
    for cluster in dict.fromkeys(r["cluster"] for r in summary):
        rows = {(r["rate"], r["method"]): r for r in summary if r["cluster"] == cluster}
        dp_slow, dp_fast = rows[("100mbit", "data parallel")], rows[("1gbit", "data parallel")]
        worst = rows[("100mbit", f"DiLoCo H={few}")]
        fast = [r for (rate, m), r in rows.items() if rate == "1gbit" and m != "data parallel"]
        hits = [r["within3_vs_dp_time"] for r in fast if r["within3_vs_dp_time"] is not None]
        out.append(
            f"- {cluster}: data parallel trains in {dp_slow['seconds']:.0f} s at 100 Mbit/s and "
            f"{dp_fast['seconds']:.0f} s at 1 Gbit/s "
            f"({dp_slow['seconds'] / dp_fast['seconds']:.1f}x as long on the slow link); its "
            f"best validation loss was {dp_slow['best_val_loss']:.3f} (step "
            f"{dp_slow['best_step']}), its final {dp_slow['final_val_loss']:.3f}. "
            f"H = {few} ({cfg['steps'] // few} outer steps in the budget) ends {_pct(worst)}. "
            + (f"At 1 Gbit/s the fastest DiLoCo run to data parallel's loss + 3% takes "
               f"{min(hits):.2f} of its time" if hits else
               "At 1 Gbit/s no DiLoCo run gets within 3% of data parallel's loss")
            + (f"; over the whole budget DiLoCo takes {min(r['vs_dp_time'] for r in fast):.2f}"
               f"-{max(r['vs_dp_time'] for r in fast):.2f} of data parallel's time." if fast else "."))
    return "\n".join(out)


def notes(cfg: dict) -> str:
    """What the settings imply for reading the figures (no measurement in it)."""
    text = os.path.getsize(os.path.join(common.REPO, "data", "sample.txt")) * 0.9
    reads = cfg["steps"] * cfg["batch"] * cfg["block"] / text
    lr, m = cfg["outer_lr"], cfg["outer_momentum"]
    few = max(cfg["H"])
    out = (f"The training text is {text / 1e3:.1f} KB and the budget reads it about "
           f"{reads:.0f} times, so a run can overfit it: the lines above give data parallel's "
           f"best validation loss beside its final one, which is the loss the bar compares "
           f"against.")
    if cfg["steps"] // few == 2:
        # Nesterov's second step: lr * (g2 + m * (m * g1 + g2))
        out += (f" H = {few} leaves 2 outer steps, and the second moves theta_outer by "
                f"{lr * (1 + m):.2f}x the averaged outer gradient plus {lr * m * m:.2f}x the "
                f"first one (Nesterov, lr {lr}, momentum {m}) with no later round to correct "
                f"an overshoot.")
    return out


def section(summary: list[dict], args, out, cfg: dict) -> str:
    hs = ", ".join(str(h) for h in cfg["H"])
    command = common.command_line(NAME, args) + (
        "" if args.shapes in (None, SHAPES) else f" --shapes {args.shapes}")
    shapes = ", ".join(dict.fromkeys(r["cluster"] for r in summary))
    return f"""## 6. DiLoCo matches data parallel with far fewer bytes on slow links (Douillard et al., arXiv 2311.08105)

**Claim.** DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models", 2023): groups that run H inner AdamW steps and then average their
parameter deltas with an outer Nesterov step (lr {cfg['outer_lr']}, momentum
{cfg['outer_momentum']}) match synchronous data parallel training while sending about H times
fewer bytes; Streaming DiLoCo (arXiv 2501.18512) sends the model in fragments on staggered
schedules. The bar: at 100 Mbit/s DiLoCo reaches data parallel's final validation loss
within 3% in at most 1/4 of its wall time with at least 50x fewer bytes.

**Setup.** The simulated cluster (`mpidist.simcluster`: a network namespace per node, its
link shaped by tc) at {shapes} (nodes x ranks per node), each at 100 Mbit/s and 1 Gbit/s.
The byte-level GPT of jobs/torch_gpt.py made smaller ({cfg['layers']} layers, dim
{cfg['dim']}, {cfg['heads']} heads, block {cfg['block']}) on data/sample.txt, the last 10%
held out ({cfg['eval_windows']} evenly spaced windows). Every variant trains for the same
token budget: {cfg['steps']} steps of {cfg['batch']} windows of {cfg['block']} bytes in all,
split evenly among the ranks (every shape trains on the same tokens), AdamW peak lr {cfg['lr']}, weight decay 0.01, the paper's learning-rate shape
(linear warm-up over {cfg['warmup']} steps, cosine decay to {cfg['end_lr']}), from the same
initial weights and windows. Data parallel: `mpidist.torch.DistributedOptimizer` over all
ranks. DiLoCo: the same AdamW within a group (one group per node), `mpidist.torch.DiLoCo`
at H = {hs} ({", ".join(str(cfg['steps'] // h) for h in cfg['H'])} outer steps in the
budget), and streaming at H = {cfg['stream_H']} with {cfg['fragments']} fragments. Bytes per
rank: data parallel 2(n-1)/n x 4 x params per step, DiLoCo what its outer allreduce reports;
the busiest simulated NIC's counter (MB, larger direction) is beside them. Wall time is
training alone (the validation passes are excluded); the validation loss is rank 0's model
(mid-round: its group's inner model; at the end every run is on theta_outer), and
"s to DP loss +3%" is the first evaluation (every {cfg['eval_every']} steps) from which the
run stays within 3% of data parallel's final loss to the end of its budget. Machine: {common.machine()}; the whole run took
{cfg['took']:.0f} s. All simulated nodes share the machine's cores: a shape with more ranks than
cores (2x2 on 2 cores) is reported for its losses and bytes, its seconds are not a speed claim.

**Command.** `{command}` (CSV: `{'docs/experiments/diloco.csv' if out.full else out.csv}`,
one row per evaluation of every run).

![DiLoCo vs data parallel]({out.figure_link()})

{table(summary)}

**Verdict.**
{verdict(summary)}

**Where DiLoCo loses.**
{losses(summary, cfg)}

{notes(cfg)}
"""
