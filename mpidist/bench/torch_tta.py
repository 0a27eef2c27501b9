"""`mpidist bench torch_tta`: time to a validation loss for the GPT of jobs/torch_gpt.py,
torch DDP over gloo against mpidist.torch, uncompressed and compressed across the network.

    mpidist bench torch_tta --cluster 2x1 --bandwidth 1gbit --steps 300 --batch 4
    python -m mpidist.launcher -n 2 -- mpidist bench torch_tta --steps 100

Compression pays where the link bounds the step, and costs steps where it biases the
update; only the time to a loss shows both. What it measures, and how: main()'s docstring.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from mpidist.bench._driver import add_cluster_options, add_worker_options, drive, init_gloo

__all__ = ["main", "first_within", "time_to", "check"]

VARIANTS = ("ddp", "mpidist", "powersgd", "onebit")
WITHIN = 0.02       # a variant reaches the target once its loss is within 2% of DDP's final
AGREE = 1e-4       # uncompressed mpidist's validation losses equal DDP's to this (relative)
WARMUP = 2          # first steps whose time is not counted (JIT compilation, first touches)
BLOCK = 64
DATA = os.path.join(os.path.dirname(__file__), "..", "..", "data", "sample.txt")


def _parse(argv):
    p = argparse.ArgumentParser(prog="mpidist bench torch_tta",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2", help="world sizes to run (comma separated)")
    p.add_argument("--steps", type=int, default=300, help="training steps of every variant")
    p.add_argument("--batch", type=int, default=4, help="64-byte windows per rank and step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    p.add_argument("--eval-every", type=int, default=10, help="steps between validations")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD's rank")
    p.add_argument("--powersgd-warmup", type=int, default=0,
                   help="PowerSGD's uncompressed first steps")
    p.add_argument("--powersgd-factors", default="float32", choices=("float32", "float16"),
                   help="the dtype PowerSGD's factors cross the network in")
    p.add_argument("--freeze-step", type=int, default=100,
                   help="1-bit Adam's uncompressed warm-up steps")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size, both sides")
    p.add_argument("--variants", default=",".join(VARIANTS), help="subset of " + ",".join(VARIANTS))
    p.add_argument("--no-flush-denormal", dest="flush_denormal", action="store_false",
                   help="keep subnormal floats (every variant's compute slows as they appear)")
    p.add_argument("--data", default=DATA, help="text to train on (its last 10%%: validation)")
    p.add_argument("--out", default=os.path.join("results", "bench", "torch_tta"))
    add_cluster_options(p)
    add_worker_options(p)
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or "ddp" not in args.variants:
        p.error(f"variants: a subset of {', '.join(VARIANTS)} with ddp, got {args.variants}")
    return args


def _worker(args) -> dict:
    # in the ranks only (the driver must not initialise MPI) and torch is optional
    import numba
    import torch
    import torch.nn.functional as F

    import mpidist.torch as mt                  # needs torch
    from mpi4py import MPI                      # initialises MPI: in the ranks only
    from mpidist.comm import Communicator       # imports mpi4py's MPI
    from mpidist.torch.models import GPT, windows

    torch.set_num_threads(1)                    # before the communicator, which otherwise
    numba.set_num_threads(1)                    # sets mpidist's default (mpidist.threads)
    # subnormal floats appear as this GPT trains and slow x86 arithmetic: without flushing
    # them, plain torch's step grows about 1.6x over 300 steps (every variant alike)
    for kind in (np.float16, np.float32, np.float64):
        np.finfo(kind)                          # cached before flushing: NumPy warns after
    torch.set_flush_denormal(args.flush_denormal)
    comm = Communicator()
    with open(args.data, "rb") as fh:
        text = torch.frombuffer(bytearray(fh.read()), dtype=torch.uint8)
    cut = int(0.9 * len(text))
    train, (vx, vy) = text[:cut], windows(text[cut:], 0, 0, 64, BLOCK)

    def adamw(params):                          # the same torch optimizer on every side
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, fused=True)

    def model():
        torch.manual_seed(0)
        return GPT(block=BLOCK)

    nets, opts = {}, {}
    if "ddp" in args.variants:
        init_gloo(comm)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model(), bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
        nets["ddp"], opts["ddp"] = ddp, adamw(ddp.parameters())
    for name in ("mpidist", "powersgd"):
        if name in args.variants:
            net = nets[name] = model()
            extra = dict(compression="powersgd", compression_options={
                "rank": args.rank, "factors": args.powersgd_factors,
                "warmup_steps": args.powersgd_warmup}) if name == "powersgd" else {}
            opts[name] = mt.DistributedOptimizer(net, adamw(net.parameters()), comm=comm,
                                                 bucket_mb=args.bucket_mb, **extra)
    if "onebit" in args.variants:               # 1-bit Adam: its momentum compressed
        net = nets["onebit"] = model()
        opts["onebit"] = mt.DistributedOptimizer(net, "onebit_adam", lr=args.lr,
                                                 weight_decay=0.01, comm=comm,
                                                 freeze_step=args.freeze_step,
                                                 bucket_mb=args.bucket_mb)

    def val_loss(net) -> float:
        with torch.no_grad():
            return float(F.cross_entropy(net(vx).flatten(0, 1), vy.flatten()))

    spent = {k: 0.0 for k in nets}              # this rank's training seconds so far
    times = {k: [] for k in nets}
    curves: dict = {k: [] for k in nets}        # (step, seconds, validation loss)
    order = np.random.default_rng(1234)         # the same shuffles on every rank
    for step in range(args.steps):
        x, y = windows(train, step, comm.rank, args.batch, BLOCK)
        for k in order.permutation(list(nets)):
            comm.comm.Barrier()
            t0 = MPI.Wtime()
            opts[k].zero_grad()
            F.cross_entropy(nets[k](x).flatten(0, 1), y.flatten()).backward()
            opts[k].step()
            dt = MPI.Wtime() - t0
            if step >= WARMUP:
                spent[k] += dt
                times[k].append(dt)
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            for k, net in nets.items():         # the slowest rank's time: the job's
                seconds = comm.comm.allreduce(spent[k], op=MPI.MAX)
                curves[k].append((done, seconds, val_loss(net)))
    steps_ms = {}
    for k, t in times.items():                  # the slowest rank's, step by step
        slowest = np.empty(len(t))
        comm.comm.Allreduce(np.asarray(t), slowest, op=MPI.MAX)
        steps_ms[k] = 1e3 * float(np.median(slowest))
    params = sum(p.numel() for p in nets["ddp"].parameters())
    for opt in opts.values():
        if isinstance(opt, mt.DistributedOptimizer):
            opt.close()
    torch.distributed.destroy_process_group()
    out = {"ranks": comm.size, "nodes": comm.num_nodes, "batch_per_rank": args.batch,
           "params": params, "curves": curves, "step_ms": steps_ms}
    comm.free()
    return out


def first_within(curve, target: float):
    """The first point (step, seconds, loss) of curve at or below target, or None."""
    return next((point for point in curve if point[2] <= target), None)


def time_to(curve, target: float):
    """(step, seconds) of the first point of curve [(step, seconds, loss)] at or below
    target, or None."""
    point = first_within(curve, target)
    return None if point is None else tuple(point[:2])


def check(rows) -> str | None:
    """Why the run is void (uncompressed mpidist, the same optimizer on the same data,
    did not follow DDP's validation losses), or None."""
    for r in rows:
        ddp, ours = r["curves"]["ddp"], r["curves"].get("mpidist")
        if ours is None:
            continue
        worst = max(abs(a[2] - b[2]) / abs(a[2]) for a, b in zip(ddp, ours))
        if not worst <= AGREE:
            return (f"{r['ranks']} ranks: uncompressed mpidist's validation loss is "
                    f"{worst:.1e} (relative) from DDP's; they train the same model alike")
    return None


def _report(rows, args) -> str:
    where = f"simulated cluster {args.cluster} at {args.bandwidth}" if args.cluster else "this host"
    lines = [f"GPT of jobs/torch_gpt.py (4 layers, dim 256) on {where}, batch {args.batch} "
             f"windows of {BLOCK} bytes per rank, AdamW lr {args.lr:g} (torch fused=True; "
             f"onebit: mpidist's 1-bit Adam), {args.steps} steps, variants shuffled each step, "
             f"subnormals {'flushed' if args.flush_denormal else 'kept'}",
             f"target: DDP's final validation loss + {WITHIN:.0%}; time: the slowest rank's "
             f"training seconds from step {WARMUP} on (validation not counted)"]
    head = (f"{'ranks':>5} {'variant':>9} {'step ms':>8} {'final val':>9} {'reached at':>11} "
            f"{'its loss':>8} {'seconds':>8} {'of DDP':>7}")
    lines += [head, "-" * len(head)]
    for r in rows:
        ddp = r["curves"]["ddp"]
        target, total = ddp[-1][2] * (1 + WITHIN), ddp[-1][1]
        for k, curve in r["curves"].items():
            hit = first_within(curve, target)
            at = f"step {hit[0]}" if hit else "-"
            loss = f"{hit[2]:.4f}" if hit else "-"
            sec = f"{hit[1]:.1f}" if hit else "-"
            share = f"{hit[1] / total:.2f}" if hit else "-"
            lines.append(f"{r['ranks']:>5} {k:>9} {r['step_ms'][k]:>8.1f} {curve[-1][2]:>9.4f} "
                         f"{at:>11} {loss:>8} {sec:>8} {share:>7}")
        lines.append(f"{'':>5} DDP's wall time {total:.1f} s to its final loss {ddp[-1][2]:.4f} "
                     f"(target {target:.4f}); {r['params'] / 1e6:.1f}M parameters "
                     f"({4 * r['params'] / 1e6:.1f} MB of fp32 gradients per step)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code.

    Every variant trains its own copy of the GPT (mpidist.torch.models.GPT, seed 0) on the
    same windows of --data (each rank its own, seeded by step and rank; the last 10% of the
    text held out), in the same processes, taking turns step by step in a shuffled order,
    each step after a barrier:
        ddp       torch DDP over gloo, torch AdamW(fused=True), uncompressed
        mpidist   mpidist.torch.DistributedOptimizer wrapping the same AdamW, uncompressed
        powersgd  the same with compression="powersgd" (rank --rank, error feedback,
                  factors sent as --powersgd-factors)
        onebit    mpidist's 1-bit Adam (its momentum sign-compressed after a warm-up)
    Every --eval-every steps, the validation loss on 64 held-out windows and each variant's
    training seconds so far (the slowest rank's; the first WARMUP steps not counted).
    Reported: per variant, the step and the
    seconds at which its validation loss first came within WITHIN of DDP's final one, and
    those seconds over DDP's whole training time.
    """
    args = _parse(argv)
    os.makedirs(args.out, exist_ok=True)
    return drive("torch_tta", args, _worker, _report,
                 ["--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr),
                  "--eval-every", str(args.eval_every), "--rank", str(args.rank),
                  "--freeze-step", str(args.freeze_step),
                  "--powersgd-warmup", str(args.powersgd_warmup),
                  "--powersgd-factors", args.powersgd_factors,
                  "--bucket-mb", str(args.bucket_mb), "--variants", ",".join(args.variants),
                  *([] if args.flush_denormal else ["--no-flush-denormal"]),
                  "--data", os.path.abspath(args.data)], check=check)
