"""The experiment's section of docs/EXPERIMENTS.md: setup, table and verdict."""
from __future__ import annotations

import numpy as np

from experiments import common
from experiments.centralized import JOB, NAME
from experiments.centralized.model import model_reduction
from experiments.centralized.overhead import reduction


def section(rows, args, out, cfg, bw, took) -> str:
    ps = sorted({r["workers"] for r in rows})
    tab = ["| workers | architecture | overhead s/step (median of rounds; range) | wall s/step | "
           "busiest NIC MB/step | test accuracy |", "|---|---|---|---|---|---|"]
    for p in ps:
        for a in ("1 server (PS, BSP)", "ring allreduce (dp)"):
            rs = [r for r in rows if r["workers"] == p and r["architecture"] == a]
            ov = [r["overhead_s_per_step"] for r in rs]
            tab.append(f"| {p} | {a} | {np.median(ov):.3f} ({min(ov):.3f}-{max(ov):.3f}) | "
                       f"{np.median([r['wall_s_per_step'] for r in rs]):.3f} | "
                       f"{np.median([r['busiest_nic_MB_per_step'] for r in rs]):.2f} | "
                       f"{np.median([r['test_accuracy'] for r in rs]):.3f} |")
    red = {p: reduction(rows, p) for p in ps}
    lines = ", ".join(f"{red[p] * 100:.0f}% at p = {p} (model {model_reduction(p) * 100:.0f}%)"
                      for p in ps)
    near = [p for p in ps if abs(red[p] - 0.75) <= 0.10]
    verdict = (f"The paper's 75% is matched within 10 points at p = {', '.join(map(str, near))}"
               if near else "The paper's 75% is NOT matched within 10 points at any p here")
    # why p = 2 falls short: the ring's fixed per-step costs against its bandwidth term
    ring2 = [r for r in rows if r["workers"] == min(ps) and r["architecture"].startswith("ring")]
    ring_model = 2 * (min(ps) - 1) / min(ps) * cfg["params"] * 4 / (cfg["rate"] / 8)
    ring_ratio = np.median([r["overhead_s_per_step"] for r in ring2]) / ring_model
    ps2 = [r for r in rows if r["workers"] == min(ps) and not r["architecture"].startswith("ring")]
    ps_model = 2 * min(ps) * cfg["params"] * 4 / (cfg["rate"] / 8)
    ps_ratio = np.median([r["overhead_s_per_step"] for r in ps2]) / ps_model
    verdict += (f"; where the model puts it (p = 2) the measured saving is smaller because the "
                f"ring's overhead per step is {ring_ratio:.1f}x its bandwidth term at p = "
                f"{min(ps)} (Python-driven steps and TCP, which the model leaves out), the "
                f"server's {ps_ratio:.1f}x its own. " if red.get(2) is not None and
                abs(red[2] - 0.75) > 0.10 else ". ")
    rounds = cfg["rounds"]
    return f"""## 2. Decentralized training "eliminates 75% of the communication overhead" (Yang, ICIAAI 2025)

**Claim.** A decentralized architecture eliminates 75% of the communication overhead of a
centralized one (the case studies of Yang, "Analysis of Distributed Training Systems and
Optimization Algorithms", ICIAAI 2025: TensorFlow parameter servers against Horovod).

**Setup.** `{JOB}` with `--set` overrides: an MLP {cfg['features']}-{'-'.join(map(str, cfg['hidden']))}-10
({cfg['params'] / 1e6:.2f} M parameters, {cfg['params'] * 4 / 2**20:.2f} MiB of float32
gradients) on synthetic data, global batch {cfg['batch']}, {cfg['steps']} steps of SGD,
the same seed. Centralized: `strategy = "ps"`, BSP, one server rank on a node of its own
(p + 1 nodes). Decentralized: `strategy = "dp"`, ring allreduce, one bucket (p nodes). The
simulated cluster: one rank per node, {bw} full-duplex links through one bridge (tc tbf),
Open MPI over TCP. Overhead per step = the job's training wall time per step minus a
worker's compute and optimizer time per step (taken from the ring run: the same
forward/backward on the same rows; rank 0 of the PS job is its server, whose metrics hold
no worker compute); NIC bytes are the job's whole traffic (set-up included) per step;
{rounds} round(s), the two architectures alternating. Machine: {common.machine()}; a shared 2-core VM.

**Command.** `{common.command_line(NAME, args)}` (root; {took:.0f} s).

![centralized]({out.figure_link()})

{chr(10).join(tab)}

**Verdict.** Reduction of the communication overhead: {lines}. {verdict}The figure is not one
number: under the bandwidth model a ring moves 2(p-1)/p model sizes per worker link while one
server moves p model sizes in and p out through its single link, so the saving grows with p
(1 - (p-1)/p^2) and the paper's 75% is the p = 2 point. Accuracy is the same up to float
summation order (BSP trains like data-parallel SGD), so the saving costs nothing in
convergence. {'Noise: the rounds give the range in brackets.' if rounds > 1 else 'One round only (--quick): no spread measured.'}
"""
