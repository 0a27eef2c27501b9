"""Centralized (one parameter server) vs decentralized (ring allreduce): the same job.

Seed 000 states that a decentralized architecture "eliminates 75% of the communication
overhead" compared to a centralized one (case studies with TensorFlow and Horovod). Here
one `mpidist train` job (an MLP on synthetic data, synchronous SGD, the same global batch,
seed and steps) runs on the simulated cluster twice per worker count p: as
`strategy = "ps"` (BSP, one server on a node of its own) and as `strategy = "dp"` with the
ring allreduce. Communication overhead = the per-step time a worker spends communicating
(the job's wall time per step less a worker's compute); the NIC counters give bytes per step.
Under the seed-003 bandwidth model the reduction is 1 - (p-1)/p^2: exactly 75% at p = 2,
81% at p = 4.
"""
from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from experiments import common

NAME = "centralized"
JOB = "jobs/synthetic_mlp.toml"


def model_reduction(p: int) -> float:
    """1 - ring time / one-server time under the bandwidth model: ring 2 (p-1) n / p,
    one server 2 p n (push, then pull, through its one link)."""
    return 1 - (2 * (p - 1) / p) / (2 * p)


def _run(cluster, p: int, central: bool, cfg: dict, tmp: str, rnd: int) -> dict:
    over = {"job.steps": cfg["steps"], "job.eval_every": 0, "model.hidden": cfg["hidden"],
            "data.features": cfg["features"], "data.samples": cfg["samples"],
            "data.batch_size": cfg["batch"], "data.cache_dir": os.path.join(tmp, "data"),
            "optim.lr": 0.05}
    if central:
        over.update({"parallel.strategy": "ps", "parallel.consistency": "bsp",
                     "parallel.servers": 1})
    else:
        over.update({"parallel.strategy": "dp", "parallel.algorithm": "ring",
                     "parallel.bucket_mb": 0.0})
    n = p + 1 if central else p
    before = cluster.nic_counters()
    out = os.path.join(tmp, f"{'ps' if central else 'ring'}-p{p}-r{rnd}")
    summary, records = common.mpidist_train(n, JOB, over, out, timeout=900, cluster=cluster,
                                            thread_level="serialized")
    after = cluster.nic_counters()
    steps = [r for r in records if r.get("event") == "step"]
    sent = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
    work = steps[1:] or steps
    return {"architecture": "1 server (PS, BSP)" if central else "ring allreduce (dp)",
            "workers": p, "nodes": n, "round": rnd,
            "wall_s_per_step": (summary["train_seconds"] - _jit(steps)) / summary["steps"],
            "compute_s_per_step": None if central else
            float(np.median([r["t_compute"] + r["t_optim"] for r in work])),
            "busiest_nic_MB_per_step": max(max(t, r) for t, r in sent) / summary["steps"] / 1e6,
            "test_accuracy": summary["test_accuracy"], "train_s": summary["train_seconds"]}


def _jit(steps: list[dict]) -> float:
    """The first step's optimizer time beyond the others' median: Numba compiling (or
    loading) its kernels inside the data-parallel loop; the parameter server compiles
    before its loop, so this alone is taken out of the data-parallel wall time."""
    if len(steps) < 2 or steps[0]["t_compute"] == 0.0 and steps[0]["t_optim"] == 0.0:
        return 0.0
    return max(steps[0]["t_optim"] - float(np.median([r["t_optim"] for r in steps[1:]])), 0.0)


def _overheads(rows: list[dict]) -> list[dict]:
    """Communication overhead per step = wall time per step - a worker's compute and
    optimizer time per step, the latter from the ring run of the same round and p (rank 0
    of the parameter-server job is a server, whose metrics hold no worker compute; a PS
    worker computes the same forward/backward on the same rows)."""
    for r in rows:
        twin = next(x for x in rows if x["round"] == r["round"] and x["workers"] == r["workers"]
                    and x["compute_s_per_step"] is not None)
        r["overhead_s_per_step"] = max(r["wall_s_per_step"] - twin["compute_s_per_step"], 0.0)
    return rows


def _plot(rows, path, title):
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
    red = [_reduction(rows, p) for p in ps]
    axes[1].plot(ps, [x * 100 for x in red], "o-", label="measured")
    axes[1].plot(ps, [model_reduction(p) * 100 for p in ps], "--", label="bandwidth model")
    axes[1].axhline(75, color="k", lw=0.8, ls=":", label="seed 000: 75%")
    axes[1].set(xlabel="workers p", ylabel="reduction of communication (%)", ylim=(0, 100),
                title="decentralized vs centralized")
    for ax in axes:
        ax.set_xticks(ps)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _reduction(rows, p):
    get = lambda a: np.median([r["overhead_s_per_step"] for r in rows if r["workers"] == p and
                               r["architecture"] == a])
    return 1 - get("ring allreduce (dp)") / get("1 server (PS, BSP)")


def _section(rows, args, out, cfg, bw, took) -> str:
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
    red = {p: _reduction(rows, p) for p in ps}
    lines = ", ".join(f"{red[p] * 100:.0f}% at p = {p} (model {model_reduction(p) * 100:.0f}%)"
                      for p in ps)
    near = [p for p in ps if abs(red[p] - 0.75) <= 0.10]
    verdict = (f"The seed's 75% is matched within 10 points at p = {', '.join(map(str, near))}"
               if near else "The seed's 75% is NOT matched within 10 points at any p here")
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
    return f"""## 2. "Eliminates 75% of the communication overhead" (seed 000)

**Claim.** A decentralized architecture eliminates 75% of the communication overhead of a
centralized one (seed 000's case studies, TensorFlow parameter servers against Horovod).

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
(1 - (p-1)/p^2) and the seed's 75% is the p = 2 point. Accuracy is the same up to float
summation order (BSP trains like data-parallel SGD), so the saving costs nothing in
convergence. {'Noise: the rounds give the range in brackets.' if rounds > 1 else 'One round only (--quick): no spread measured.'}
"""


def main(argv=None) -> int:
    args = common.parser(NAME, __doc__).parse_args(argv)
    common.need_cluster()
    from mpidist.simcluster import SimCluster
    out = common.Outputs(NAME, args)
    bw = "100mbit"
    from mpidist.simcluster import parse_rate
    if args.quick:
        cfg = {"workers": [2], "steps": 6, "hidden": [256], "features": 128, "samples": 2048,
               "batch": 128, "rounds": 1}
    else:
        cfg = {"workers": [2, 3, 4], "steps": 16, "hidden": [512, 512], "features": 256,
               "samples": 8192, "batch": 256, "rounds": 2}
    cfg["rate"] = parse_rate(bw)
    dims = [cfg["features"], *cfg["hidden"], 10]
    cfg["params"] = sum(a * b + b for a, b in zip(dims, dims[1:]))
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpidist-exp-") as tmp, \
            SimCluster(nodes=max(cfg["workers"]) + 1, ranks_per_node=1, bandwidth=bw) as cluster:
        for rnd in range(cfg["rounds"]):
            for p in cfg["workers"]:
                order = (True, False) if (rnd + p) % 2 == 0 else (False, True)
                for central in order:
                    rows.append(_run(cluster, p, central, cfg, tmp, rnd))
    took = time.perf_counter() - t0
    rows = _overheads(rows)
    out.write_csv(rows)
    _plot(rows, out.png, f"same job, centralized vs decentralized, {bw} links")
    out.write_section(_section(rows, args, out, cfg, bw, took))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
