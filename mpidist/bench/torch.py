"""`mpidist bench torch`: one torch model trained by torch DDP (gloo) and by mpidist.torch.

    mpidist bench torch                              # runs itself on 1, 2 and 4 ranks
    mpidist bench torch --ranks 2 --steps 20 --variants ddp,mpidist
    mpidist bench torch --model gpt
    python -m mpidist.launcher -n 2 -- mpidist bench torch    # this world size only

What it measures, and how: main()'s docstring. See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np

from mpidist.bench._driver import (add_cluster_options, add_worker_options, drive,
                                   in_build_order, init_gloo)
from mpidist.bench._bounds import at_payload_rate, link_bound, overlap_bound
from mpidist.simcluster import parse_rate

__all__ = ["main"]

VARIANTS = ("torch", "ddp", "mpidist", "mpidist-fused", "zero2")
TOLERANCE = 1e-5    # the variants' parameters agree to this (relative), or the bench fails
# pairs with mpidist's own SGD kernel: it rounds otherwise than torch's, and in a ReLU
# network one rounding can flip a unit, after which the runs drift apart by a gradient
# of that unit per step (seen: 1e-7 for 11 steps, then 1.4e-5 after 18 at 8 ranks)
OWN_KERNEL_TOLERANCE = 1e-4
OWN_KERNEL = ("mpidist-fused", "zero2")
MODELS = ("mlp", "gpt")
IN, HIDDEN, CLASSES = 1024, 2048, 10
BLOCK = 64          # the GPT's context (bytes per window)


def _parse(argv):
    p = argparse.ArgumentParser(prog="mpidist bench torch", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2,4", help="world sizes to run (comma separated)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--model", default="mlp", choices=MODELS, help="the model trained")
    p.add_argument("--batch", type=int, default=None,
                   help="samples per rank (default: mlp 128, gpt 16 windows)")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="mpidist gradient bucket size")
    p.add_argument("--algorithm", default="auto", help="mpidist allreduce algorithm")
    p.add_argument("--variants", default=",".join(VARIANTS), help="subset of " + ",".join(VARIANTS))
    p.add_argument("--out", default=None,
                   help="output directory (default results/bench/torch, gpt: .../torch_gpt)")
    p.add_argument("--threads", default="1", choices=("1", "auto"),
                   help="threads per rank for torch and Numba: 1 (default), or auto: what "
                        "mpidist sets by itself under this launcher (mpidist.threads)")
    add_cluster_options(p)
    add_worker_options(p, build_order=True)
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    if args.batch is None:
        args.batch = 128 if args.model == "mlp" else 16
    if args.out is None:
        args.out = os.path.join("results", "bench", "torch" if args.model == "mlp" else "torch_gpt")
    return args


def _model(name: str):
    """A fresh copy of the model, the same initial values every time."""
    import torch                        # optional: mpidist runs without it
    torch.manual_seed(0)
    if name == "gpt":
        from mpidist.torch.models import GPT   # needs torch, as above
        return GPT(block=BLOCK)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def _data(name: str, batch: int, rank: int):
    """(inputs, targets, loss function) of this rank's synthetic batch."""
    import torch                        # optional: mpidist runs without it
    gen = torch.Generator().manual_seed(rank)
    if name == "gpt":
        tokens = torch.randint(0, 256, (batch, BLOCK + 1), generator=gen)

        def loss(logits, y):
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        return tokens[:, :-1], tokens[:, 1:], loss
    x = torch.randn(batch, IN, generator=gen)
    y = torch.randint(0, CLASSES, (batch,), generator=gen)
    return x, y, torch.nn.functional.cross_entropy


# ----------------------------------------------------------------------------- one world size
def _worker(args) -> dict:
    # in the ranks only: the driver process, which starts them, must not initialise MPI, and
    # torch is optional
    import numba
    import torch
    import torch.distributed as dist

    import mpidist.torch as mt                  # needs torch
    from mpi4py import MPI                      # initialises MPI: in the ranks only
    from mpidist.comm import Communicator       # imports mpi4py's MPI

    if args.threads == "1":                     # before the communicator, which otherwise
        torch.set_num_threads(1)                # sets mpidist's default (mpidist.threads)
        numba.set_num_threads(1)
    comm = Communicator()
    x, y, loss_fn = _data(args.model, args.batch, comm.rank)
    steps: dict = {}
    nets: dict = {}                             # variant -> the module it trains
    ready: dict = {}                            # mpidist variant -> (bucket bytes, per step
                                                # the seconds into it each bucket launched)

    def sgd(params):                            # the same torch optimizer on every side
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True)

    def timed(net, opt, wait=lambda t0: (0.0, None)):
        def step():
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            t1 = time.perf_counter()
            opt.step()
            t_wait, t_optim = wait(t0)
            t2 = time.perf_counter()
            return t1 - t0, t_wait, (t2 - t1 - t_wait) if t_optim is None else t_optim
        return step

    def plain():
        net = nets["torch"] = _model(args.model)
        return timed(net, sgd(net.parameters()))

    def ddp():
        init_gloo(comm)
        model = torch.nn.parallel.DistributedDataParallel(
            _model(args.model), bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
        nets["ddp"] = model.module
        return timed(model, sgd(model.parameters()))

    def mpidist_variant(name, zero):
        net = nets[name] = _model(args.model)
        fused = name != "mpidist"             # mpidist's own fused SGD kernel
        opt = "sgd" if fused else sgd(net.parameters())
        kwargs = dict(lr=0.01, momentum=0.9) if fused else {}
        mopt = mt.DistributedOptimizer(net, opt, comm=comm, zero=zero, bucket_mb=args.bucket_mb,
                                       algorithm=args.algorithm, **kwargs)
        size = mopt.storage.grads.dtype.itemsize
        ready[name] = ([size * (hi - lo) for lo, hi in mopt.buckets.buckets], [])

        def wait(t0):
            s = mopt.last_step
            ready[name][1].append([t - t0 for t in s["launched_at"]])
            return s["t_wait"], s["t_optim"]
        return timed(net, mopt, wait)

    builders = {"torch": plain, "ddp": ddp,
                "mpidist": lambda: mpidist_variant("mpidist", 0),
                "mpidist-fused": lambda: mpidist_variant("mpidist-fused", 0),
                "zero2": lambda: mpidist_variant("zero2", 2)}
    for name in in_build_order([v for v in VARIANTS if v in args.variants], args):
        steps[name] = builders[name]()
    steps = {k: steps[k] for k in VARIANTS if k in steps}   # the rounds' shuffles: one order

    times = {k: [] for k in steps}
    order = np.random.default_rng(1234)         # the same shuffles on every rank
    names = list(steps)
    for i in range(args.warmup + args.steps):
        for k in order.permutation(names):
            comm.comm.Barrier()
            t0 = time.perf_counter()
            parts = steps[k]()
            total = time.perf_counter() - t0
            if i >= args.warmup:
                times[k].append((total,) + parts)
    out = {"ranks": comm.size, "batch_per_rank": args.batch, "nodes": comm.num_nodes,
           "params": sum(p.numel() for p in _model(args.model).parameters()),
           "agree": _agreement(comm, nets), "build_orders": [args.build_order], "raw": {}}
    for k, rows in times.items():
        a = np.asarray(rows)
        mx = np.empty_like(a)
        comm.comm.Allreduce(a, mx, op=MPI.MAX)
        out["raw"][k] = mx.tolist()
    out["ready"] = {}
    for k, (nbytes, at) in ready.items():        # the timed steps, the last rank ready
        a = np.asarray(at[args.warmup:], dtype=np.float64)
        mx = np.empty_like(a)
        comm.comm.Allreduce(a, mx, op=MPI.MAX)
        out["ready"][k] = {"bytes": nbytes, "at": mx.tolist()}
    out.update(_figures(out))
    if "ddp" in args.variants:
        dist.destroy_process_group()
    comm.free()
    return out


def _agreement(comm, nets) -> dict:
    """The largest relative difference between the parameters of the data-parallel
    variants (all trained from one start on the same batches), and which pair: among those
    stepping torch's SGD (max_rel_diff, pair), and in pairs with mpidist's own kernel
    (own_kernel: the same two keys). Plain torch trains on one rank's batch alone, so it is
    left out where there are several ranks."""
    import torch                        # optional, as above
    from mpi4py import MPI              # in the ranks only, as above
    names = [k for k in nets if k != "torch" or comm.size == 1]
    flat = {k: torch.cat([p.detach().reshape(-1).double() for p in nets[k].parameters()])
            for k in names}
    worst = {False: [0.0, None], True: [0.0, None]}     # own kernel in the pair -> d, pair
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            scale = float(flat[a].abs().max()) or 1.0
            d = float((flat[a] - flat[b]).abs().max()) / scale
            w = worst[a in OWN_KERNEL or b in OWN_KERNEL]
            if d > w[0] or w[1] is None:
                w[:] = d, (a, b)
    same, own = (comm.comm.allreduce(worst[k][0], op=MPI.MAX) for k in (False, True))
    return {"max_rel_diff": same, "pair": worst[False][1], "variants": names,
            "own_kernel": {"max_rel_diff": own, "pair": worst[True][1]}}


def _figures(row) -> dict:
    """Each variant's medians from row["raw"] (per timed step, the slowest rank's total,
    compute, wait and optimizer seconds; rounds in the same order for every variant)."""
    raw = {k: np.asarray(v) for k, v in row["raw"].items()}
    out = {}
    for k, mx in raw.items():
        step, compute, wait, optim = (float(np.median(mx[:, j])) for j in range(4))
        if k == "ddp" and "torch" in raw:
            # DDP's communication overlaps its backward: what it adds is its forward and
            # backward minus plain torch's, in the same round
            exposed = float(np.median(mx[:, 1] - raw["torch"][:, 1]))
            compute, wait = compute - exposed, exposed
        out[k] = {"step": step, "compute": compute, "comm": wait, "optim": optim,
                  "samples_per_s": row["batch_per_rank"] * row["ranks"] / step}
    return out


def merge(rows) -> dict:
    """One row from the jobs of one rank count, one per build order: the rounds of both
    pooled, the worst parameter agreement kept."""
    out = dict(rows[0])
    out["raw"] = {k: [x for r in rows for x in r["raw"][k]] for k in rows[0]["raw"]}
    # the worst agreement (NaN, which never passes the check, counts as the worst)
    def worst(agreements):
        return max(agreements, key=lambda a: (math.isnan(a["max_rel_diff"]), a["max_rel_diff"]))
    out["agree"] = worst([r["agree"] for r in rows])
    if all("own_kernel" in r["agree"] for r in rows):
        out["agree"] = {**out["agree"],
                        "own_kernel": worst([r["agree"]["own_kernel"] for r in rows])}
    out["build_orders"] = [o for r in rows for o in r["build_orders"]]
    out["ready"] = {k: {"bytes": v["bytes"], "at": [x for r in rows for x in r["ready"][k]["at"]]}
                    for k, v in rows[0].get("ready", {}).items()}
    out.update(_figures(out))
    return out


# ----------------------------------------------------------------------------- driver
def _report(rows, args) -> str:
    head = (f"{'ranks':>5} {'variant':>13} {'step ms':>8} {'compute':>8} {'exp.comm':>8} "
            f"{'optim':>6} {'samples/s':>10} {'ratio':>6} {'compute%':>8} {'link%':>6}")
    model = f"MLP {IN}-{HIDDEN}-{HIDDEN}-{CLASSES}" if args.model == "mlp" else \
        f"GPT (4 layers, dim 256, {BLOCK}-byte windows)"
    where = f"simulated cluster {args.cluster} at {args.bandwidth}" if args.cluster else "this host"
    lines = [f"{model} ({rows[0]['params'] / 1e6:.1f}M params) on {where}, batch {args.batch}/rank, "
             f"momentum SGD (torch fused=True unless -fused: mpidist's kernel), "
             f"{'one thread' if args.threads == '1' else 'mpidist default threads'} per "
             f"rank, {args.bucket_mb:g} MB buckets, {args.steps} timed steps, variants shuffled "
             f"each round, built in the order(s) {', '.join(rows[0].get('build_orders', ['forward']))}"
             f" (rounds pooled); medians of the slowest rank",
             "ratio: samples/s over ddp's (plain torch's at 1 rank); compute%: of plain torch's "
             "(no communication); link%: of bytes per step over the bandwidth",
             head, "-" * len(head)]
    rate = parse_rate(args.bandwidth) if args.cluster else None
    for r in rows:
        base = r.get("torch" if r["ranks"] == 1 else "ddp")
        bound = link_bound(r["params"], r["ranks"], r.get("nodes", 1), r["batch_per_rank"], rate)
        for v in VARIANTS:
            if v not in r:
                continue
            m = r[v]
            ratio = f"{m['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
            comp = f"{100 * m['samples_per_s'] / r['torch']['samples_per_s']:.0f}%" \
                if "torch" in r else "-"
            link = f"{100 * m['samples_per_s'] / bound[1]:.0f}%" if bound else "-"
            lines.append(f"{r['ranks']:>5} {v:>13} {m['step'] * 1e3:>8.1f} "
                         f"{m['compute'] * 1e3:>8.1f} {m['comm'] * 1e3:>8.1f} "
                         f"{m['optim'] * 1e3:>6.1f} {m['samples_per_s']:>10.0f} {ratio:>6} "
                         f"{comp:>8} {link:>6}")
        if bound:
            lines.append(f"{'':>5} link bound: {bound[0] / 1e6:.1f} MB per rank per step, "
                         f"{bound[1]:.0f} samples/s")
        which = next((v for v in VARIANTS if v in r.get("ready", {})), None)
        over = overlap_bound(r["ready"][which], r.get("nodes", 1), rate) if which else None
        if over:
            (step, b), ready = over, r["ready"][which]
            at = float(np.median([a[b] for a in ready["at"]]))
            rest = sum(ready["bytes"][b:]) / 1e6
            samples = r["batch_per_rank"] * r["ranks"]
            shares = ", ".join(f"{v} {100 * r[v]['samples_per_s'] * step / samples:.0f}%"
                               for v in VARIANTS if v in r and v != "torch")
            lines.append(f"{'':>5} overlap bound: {step * 1e3:.1f} ms per step, "
                         f"{samples / step:.0f} samples/s ({which}'s bucket {b + 1} of "
                         f"{len(ready['bytes'])} final {at * 1e3:.1f} ms into the step, then "
                         f"{rest:.1f} MB of buckets at the link's rate): {shares}")
        if bound:
            lines.append(at_payload_rate(r, which, rate, VARIANTS))
        a = r["agree"]
        own = a.get("own_kernel", {}).get("pair")
        lines.append(f"{'':>5} parameters of {', '.join(a['variants'])}: largest relative "
                     f"difference {a['max_rel_diff']:.1e} ({' vs '.join(a['pair'] or ())}; "
                     f"must be <= {TOLERANCE:g})" +
                     (f", with mpidist's kernel {a['own_kernel']['max_rel_diff']:.1e} "
                      f"({' vs '.join(own)}; <= {OWN_KERNEL_TOLERANCE:g})" if own else ""))
    return "\n".join(lines)


def check(rows) -> str | None:
    """Why the rows are not a fair comparison (the variants' parameters differ), or None."""
    bad = [f"{r['ranks']} ranks: {a['max_rel_diff']:.1e} ({' vs '.join(a['pair'])})"
           for r in rows for a, tol in ((r["agree"], TOLERANCE),
                                        (r["agree"].get("own_kernel", {}), OWN_KERNEL_TOLERANCE))
           if a.get("pair") and not a["max_rel_diff"] <= tol]
    return ("the variants ended with different parameters: " + "; ".join(bad)) if bad else None


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code.

    Models (--model): "mlp", the MLP 1024-2048-2048-10 (6.3M parameters), --batch synthetic
    samples per rank (default 128); "gpt", the GPT of jobs/torch_gpt.py (mpidist.torch.models:
    4 layers, dim 256, byte-level, 3.3M parameters), --batch random windows of 64 bytes per
    rank (default 16). Momentum SGD (lr 0.01, momentum 0.9), one thread per rank (torch and
    Numba). Variants, each its own copy of the model, in the same processes, taking turns
    step by step in an order shuffled every round (a change of the machine's load hits all
    alike; each step starts after a barrier):
        torch          plain torch, torch.optim.SGD(fused=True), no communication
        ddp            torch DDP over gloo, the same SGD, gradient_as_bucket_view=True, the
                       same bucket size
        mpidist        mpidist.torch.DistributedOptimizer wrapping the same SGD
        mpidist-fused  the same with mpidist's own fused SGD ("sgd")
        zero2          mpidist's SGD with zero=2: buckets reduce-scattered, momentum sharded,
                       parameters allgathered after the update
    Each rank count runs twice, the variants built in one order and then in the other (a
    model built first can run slower after another's turn), and the rounds of both are
    pooled. Each step is split into compute (forward and backward: for ddp with its
    overlapped communication), exposed communication (ddp: its forward+backward minus plain
    torch's in the same round; mpidist: the wait in step()) and optimizer; times are the
    slowest rank's, medians over the timed steps. Reported: samples/s and the ratio to ddp
    (to plain torch on one rank, where DDP has nothing to do); on a simulated cluster the
    share of the link bound and of the overlap bound (overlap_bound: mpidist's own buckets,
    each final when its hooks launched it on the last rank), and both again at the rate TCP's
    payload gets (_bounds.tcp_payload_share). The run fails unless the
    data-parallel variants end with the same parameters (check).
    """
    args = _parse(argv)
    return drive("torch", args, _worker, _report,
                 ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
                  "--batch", str(args.batch), "--bucket-mb", str(args.bucket_mb),
                  "--algorithm", args.algorithm, "--variants", ",".join(args.variants),
                  "--threads", args.threads],
                 check=check, merge=merge)
