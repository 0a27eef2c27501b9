"""`mpidist bench torch`: one torch model trained by torch DDP (gloo) and by mpidist.torch.

    mpidist bench torch                              # runs itself on 1, 2 and 4 ranks
    mpidist bench torch --ranks 2 --steps 20 --variants ddp,mpidist
    mpidist bench torch --model gpt
    python -m mpidist.launcher -n 2 -- mpidist bench torch    # this world size only

What it measures, and how: main()'s docstring. See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import numpy as np

from mpidist.bench._driver import drive

__all__ = ["main"]

VARIANTS = ("torch", "ddp", "mpidist", "zero2")
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
    p.add_argument("--worker", action="store_true", help="measure at the current world size (under mpiexec)")
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    torch.set_num_threads(1)
    numba.set_num_threads(1)
    comm = Communicator()
    x, y, loss_fn = _data(args.model, args.batch, comm.rank)
    steps: dict = {}

    if "torch" in args.variants:
        net = _model(args.model)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, foreach=True)

        def plain():
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            t1 = time.perf_counter()
            opt.step()
            return t1 - t0, 0.0, time.perf_counter() - t1
        steps["torch"] = plain

    if "ddp" in args.variants:
        port = comm.comm.bcast(_free_port() if comm.rank == 0 else None, root=0)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
        ddp = torch.nn.parallel.DistributedDataParallel(_model(args.model))
        dopt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9, foreach=True)

        def ddp_step():
            t0 = time.perf_counter()
            dopt.zero_grad()
            loss_fn(ddp(x), y).backward()
            t1 = time.perf_counter()
            dopt.step()
            return t1 - t0, 0.0, time.perf_counter() - t1
        steps["ddp"] = ddp_step

    def mpidist_variant(zero):
        mnet = _model(args.model)
        mopt = mt.DistributedOptimizer(mnet, "sgd", lr=0.01, momentum=0.9, comm=comm, zero=zero,
                                       bucket_mb=args.bucket_mb, algorithm=args.algorithm)

        def mpidist_step():
            t0 = time.perf_counter()
            mopt.zero_grad()
            loss_fn(mnet(x), y).backward()
            t1 = time.perf_counter()
            mopt.step()
            t = mopt.last_step
            return t1 - t0, t["t_wait"], t["t_optim"]
        return mpidist_step

    for name, zero in (("mpidist", 0), ("zero2", 2)):
        if name in args.variants:
            steps[name] = mpidist_variant(zero)

    times = {k: [] for k in steps}
    for i in range(args.warmup + args.steps):
        for k, fn in steps.items():
            comm.comm.Barrier()
            t0 = time.perf_counter()
            parts = fn()
            total = time.perf_counter() - t0
            if i >= args.warmup:
                times[k].append((total,) + parts)
    out = {"ranks": comm.size, "batch_per_rank": args.batch,
           "params": sum(p.numel() for p in _model(args.model).parameters())}
    slowest = {}
    for k, rows in times.items():
        a = np.asarray(rows)
        mx = np.empty_like(a)
        comm.comm.Allreduce(a, mx, op=MPI.MAX)
        slowest[k] = mx
    for k, mx in slowest.items():
        step, compute, wait, optim = (float(np.median(mx[:, j])) for j in range(4))
        if k == "ddp" and "torch" in slowest:
            # DDP's communication overlaps its backward: what it adds is its forward and
            # backward minus plain torch's, in the same round
            exposed = float(np.median(mx[:, 1] - slowest["torch"][:, 1]))
            compute, wait = compute - exposed, exposed
        out[k] = {"step": step, "compute": compute, "comm": wait, "optim": optim,
                  "samples_per_s": args.batch * comm.size / step}
    if "ddp" in args.variants:
        dist.destroy_process_group()
    comm.free()
    return out


# ----------------------------------------------------------------------------- driver
def _report(rows, args) -> str:
    head = (f"{'ranks':>5} {'variant':>8} {'step ms':>8} {'compute':>8} {'exp.comm':>8} "
            f"{'optim':>6} {'samples/s':>10} {'ratio':>6}")
    model = f"MLP {IN}-{HIDDEN}-{HIDDEN}-{CLASSES}" if args.model == "mlp" else \
        f"GPT (4 layers, dim 256, {BLOCK}-byte windows)"
    lines = [f"{model} ({rows[0]['params'] / 1e6:.1f}M params), "
             f"batch {args.batch}/rank, momentum SGD, one thread per rank, {args.steps} timed "
             f"steps alternated; ratio: samples/s over ddp's (plain torch's at 1 rank)",
             head, "-" * len(head)]
    for r in rows:
        base = r.get("torch" if r["ranks"] == 1 else "ddp")
        for v in VARIANTS:
            if v not in r:
                continue
            m = r[v]
            ratio = f"{m['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
            lines.append(f"{r['ranks']:>5} {v:>8} {m['step'] * 1e3:>8.1f} "
                         f"{m['compute'] * 1e3:>8.1f} {m['comm'] * 1e3:>8.1f} "
                         f"{m['optim'] * 1e3:>6.1f} {m['samples_per_s']:>10.0f} {ratio:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code.

    Models (--model): "mlp", the MLP 1024-2048-2048-10 (6.3M parameters), --batch synthetic
    samples per rank (default 128); "gpt", the GPT of jobs/torch_gpt.py (mpidist.torch.models:
    4 layers, dim 256, byte-level, 3.3M parameters), --batch random windows of 64 bytes per
    rank (default 16). Momentum SGD (lr 0.01, momentum 0.9), one thread per rank (torch and
    Numba). Variants, each
    its own copy of the model, in the same processes, taking turns step by step (a change of
    the machine's load hits all alike; each step starts after a barrier):
        torch      plain torch, torch.optim.SGD(foreach=True), no communication
        ddp        torch.nn.parallel.DistributedDataParallel over gloo, the same SGD
        mpidist    mpidist.torch.DistributedOptimizer("sgd"): dp, buckets during backward
        zero2      the same with zero=2: buckets reduce-scattered, momentum sharded, parameters
                   allgathered after the update
    Each step is split into compute (forward and backward: for ddp with its overlapped
    communication), exposed communication (ddp: its forward+backward minus plain torch's in
    the same round; mpidist: the wait in step()) and optimizer; times are the slowest rank's,
    medians over the timed steps. Reported: samples/s and the ratio to ddp (to plain torch on
    one rank, where DDP has nothing to do).
    """
    args = _parse(argv)
    return drive("torch", args, _worker, _report,
                 ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
                  "--batch", str(args.batch), "--bucket-mb", str(args.bucket_mb),
                  "--algorithm", args.algorithm, "--variants", ",".join(args.variants)])
