"""`mpidist bench torch_backend`: torch DDP over the "mpidist" backend against DDP over gloo.

    mpidist bench torch_backend                      # runs itself on 2 and 4 ranks
    mpidist bench torch_backend --ranks 2 --steps 30 --algorithm ring
    python -m mpidist.launcher -n 2 -- mpidist bench torch_backend   # this world size only

What it measures, and how: main()'s docstring. See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from mpidist.bench._bounds import link_bound, tcp_payload_share
from mpidist.bench._driver import (add_cluster_options, add_worker_options, drive,
                                   in_build_order)
from mpidist.simcluster import parse_rate

__all__ = ["main"]

VARIANTS = ("gloo", "mpidist")
COMPUTE = "torch"       # the compute bound: the same model and step alone, no communication
IN, HIDDEN, CLASSES = 1024, 2048, 10


def _parse(argv):
    p = argparse.ArgumentParser(prog="mpidist bench torch_backend",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="world sizes to run (comma separated)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch", type=int, default=32, help="samples per rank")
    p.add_argument("--algorithm", default="auto", help="mpidist allreduce algorithm")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="DDP's bucket_cap_mb, for both backends (25 is DDP's default)")
    add_cluster_options(p)
    p.add_argument("--bucket-view", action="store_true",
                   help="DDP's gradient_as_bucket_view=True, for both backends (default: "
                        "DDP's default, False)")
    p.add_argument("--out", default=os.path.join("results", "bench", "torch_backend"),
                   help="output directory")
    add_worker_options(p, build_order=True)
    return p.parse_args(argv)


TOLERANCE = 1e-6     # the backends' parameters agree to this (relative), or the bench fails


def _mlp():
    import torch                        # optional: mpidist runs without it
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def _worker(args) -> dict:
    import torch                                        # optional: mpidist runs without it
    import torch.distributed as dist
    from mpi4py import MPI                              # initialises MPI: in the ranks only

    from mpidist.comm import Communicator               # imports mpi4py's MPI
    from mpidist.torch.backend import init_process_group   # needs torch

    torch.set_num_threads(1)
    comm = Communicator()                        # the bench's own barriers and timings
    init_process_group(algorithm=args.algorithm)
    groups = {"mpidist": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(args.batch, IN, generator=gen)
    y = torch.randint(0, CLASSES, (args.batch,), generator=gen)
    steps, nets = {}, {}
    for name in in_build_order(VARIANTS, args):
        model = torch.nn.parallel.DistributedDataParallel(_mlp(), process_group=groups[name],
                                                          bucket_cap_mb=args.bucket_mb,
                                                          gradient_as_bucket_view=args.bucket_view)
        nets[name] = model.module
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)

        def step(model=model, opt=opt):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        steps[name] = step
    plain = _mlp()
    popt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9, fused=True)

    def alone():
        popt.zero_grad()
        torch.nn.functional.cross_entropy(plain(x), y).backward()
        popt.step()
    steps[COMPUTE] = alone

    times = {k: [] for k in steps}
    order = np.random.default_rng(1234)         # the same shuffles on every rank
    for i in range(args.warmup + args.steps):
        for k in order.permutation(list(steps)):
            comm.comm.Barrier()
            t0 = time.perf_counter()
            steps[k]()
            if i >= args.warmup:
                times[k].append(time.perf_counter() - t0)
    a, b = (torch.cat([p.detach().reshape(-1).double() for p in nets[k].parameters()])
            for k in VARIANTS)
    diff = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    out = {"ranks": comm.size, "nodes": comm.num_nodes, "batch_per_rank": args.batch,
           "algorithm": args.algorithm,
           "bucket_mb": args.bucket_mb, "bucket_view": args.bucket_view,
           "params": sum(p.numel() for p in _mlp().parameters()),
           "agree": comm.comm.allreduce(diff, op=MPI.MAX)}
    for k, rows in times.items():
        slowest = np.empty(len(rows))
        comm.comm.Allreduce(np.asarray(rows), slowest, op=MPI.MAX)
        out[k] = _timing(slowest.tolist(), args.batch * comm.size)
    out["build_orders"] = [args.build_order]
    dist.destroy_process_group()
    comm.free()
    return out


def _timing(times: list, samples: int) -> dict:
    """A variant's figures from the slowest rank's step times (seconds): their median."""
    step = float(np.median(times))
    return {"step": step, "samples_per_s": samples / step, "times": times}


def merge(rows) -> dict:
    """One row from the jobs of one rank count, one per build order: each variant's step
    times pooled, the largest parameter difference kept."""
    out = dict(rows[0])
    samples = rows[0]["batch_per_rank"] * rows[0]["ranks"]
    for v in VARIANTS + (COMPUTE,):
        if all(v in r for r in rows):
            out[v] = _timing([t for r in rows for t in r[v]["times"]], samples)
    out["agree"] = max(r["agree"] for r in rows)
    out["build_orders"] = [o for r in rows for o in r["build_orders"]]
    return out


def _report(rows, args) -> str:
    head = (f"{'ranks':>5} {'backend':>8} {'step ms':>8} {'samples/s':>10} {'vs gloo':>8} "
            f"{'compute%':>8} {'link%':>6}")
    lines = [f"DDP, MLP {IN}-{HIDDEN}-{HIDDEN}-{CLASSES} ({rows[0]['params'] / 1e6:.1f}M params), "
             f"batch {args.batch}/rank, momentum SGD, DDP buckets {args.bucket_mb:g} MB"
             f"{' (gradients as bucket views)' if args.bucket_view else ''}, one "
             f"thread per rank, {args.steps} timed steps, shuffled each round; mpidist algorithm "
             f"{args.algorithm}; on "
             + (f"simulated cluster {args.cluster} at {args.bandwidth}" if args.cluster
                else "this host") + f"; variants built in the order(s) "
             f"{', '.join(rows[0].get('build_orders', ['forward']))}, steps pooled",
             f"compute%: of {COMPUTE} (the same model and step with no communication); link%: "
             "of bytes per step over the bandwidth", head, "-" * len(head)]
    rate = parse_rate(args.bandwidth) if args.cluster else None
    for r in rows:
        bound = link_bound(r["params"], r["ranks"], r.get("nodes", 1), r["batch_per_rank"], rate)
        for v in (COMPUTE,) + VARIANTS:
            if v not in r:
                continue
            m = r[v]
            ratio = "-" if v == COMPUTE else f"{m['samples_per_s'] / r['gloo']['samples_per_s']:.2f}x"
            comp = f"{100 * m['samples_per_s'] / r[COMPUTE]['samples_per_s']:.0f}%" \
                if COMPUTE in r else "-"
            link = f"{100 * m['samples_per_s'] / bound[1]:.0f}%" if bound else "-"
            lines.append(f"{r['ranks']:>5} {v:>8} {m['step'] * 1e3:>8.1f} "
                         f"{m['samples_per_s']:>10.0f} {ratio:>8} {comp:>8} {link:>6}")
        if bound:
            share = tcp_payload_share()
            _, payload = link_bound(r["params"], r["ranks"], r["nodes"], r["batch_per_rank"],
                                    rate * share)
            lines.append(f"{'':>5} link bound: {bound[0] / 1e6:.1f} MB per rank per step, "
                         f"{bound[1]:.0f} samples/s; at the TCP payload rate ({100 * share:.1f}% "
                         f"of the link) {payload:.0f} samples/s: " +
                         ", ".join(f"{v} {100 * r[v]['samples_per_s'] / payload:.0f}%"
                                   for v in VARIANTS))
        lines.append(f"{'':>5} the two models' parameters: largest relative difference "
                     f"{r['agree']:.1e} (must be <= {TOLERANCE:g})")
    return "\n".join(lines)


def check(rows) -> str | None:
    """Why the rows are void (the backends trained the model to different parameters)."""
    bad = [f"{r['ranks']} ranks: {r['agree']:.1e}" for r in rows if not r["agree"] <= TOLERANCE]
    return ("the backends ended with different parameters: " + "; ".join(bad)) if bad else None


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code.

    The same script and model for both (the MLP 1024-2048-2048-10, 6.3M parameters, --batch
    synthetic samples per rank, momentum SGD, DDP buckets of --bucket-mb, default DDP's 25 MB,
    gradients as bucket views with --bucket-view),
    one thread per rank; only the process group differs: "mpidist" (the default group, made by
    mpidist.torch.backend.init_process_group) or gloo (a group of the same ranks). The two
    models take turns step by step, each step after a barrier, so a change of the machine's load
    hits both alike. A step is zero_grad, forward, backward (DDP's bucket allreduces overlap it)
    and the optimizer; times are the slowest rank's, medians over the timed steps. Each rank
    count runs twice, the two models built in one order and then in the other (the model
    built first runs slower after a turn of the other), and the steps of both are pooled.
    Plain torch (the same model and optimizer step on this rank's batch, no communication)
    takes its turns too: the compute bound. Reported: samples/s, the ratio of mpidist's to
    gloo's, the share of the compute bound, and on a simulated cluster of the link bound
    (bytes per step over the bandwidth; again at the rate TCP's payload gets).
    """
    args = _parse(argv)
    return drive("torch_backend", args, _worker, _report,
                 ["--steps", str(args.steps), "--warmup", str(args.warmup),
                  "--batch", str(args.batch), "--algorithm", args.algorithm,
                  "--bucket-mb", str(args.bucket_mb)]
                 + (["--bucket-view"] if args.bucket_view else []), check=check, merge=merge)
