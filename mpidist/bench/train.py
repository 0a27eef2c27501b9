"""`mpidist bench train`: data-parallel training throughput, scaling and communication overlap.

    mpidist bench train                         # runs itself on 1, 2 and 4 ranks via mpiexec
    mpidist bench train --ranks 1,2 --steps 10 --out results/bench/train
    python -m mpidist.launcher -n 2 -- mpidist bench train            # one world size only

What it measures, and how: main()'s docstring. See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from mpidist.bench._driver import add_worker_options, free_port
from mpidist.launcher import run
from mpidist.nn import MLP, SoftmaxCrossEntropy, materialize
from mpidist.optim import build_optimizer

__all__ = ["main"]

HIDDEN, IN, CLASSES = 2048, 1024, 10


def _parse(argv):
    p = argparse.ArgumentParser(prog="mpidist bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2,4", help="world sizes to run (comma separated)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--batch", type=int, default=256, help="samples per rank")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="hidden layer width (two layers)")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="gradient bucket size")
    p.add_argument("--algorithm", default="ring", help="allreduce algorithm")
    p.add_argument("--out", default=os.path.join("results", "bench", "train"), help="output directory")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch DDP comparison")
    add_worker_options(p)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- one world size
def _interleaved(comm, fns: dict, steps: int, warmup: int) -> tuple[dict, dict]:
    """Median seconds per call of each fn, the slowest rank's per call, and those
    per-round times themselves.

    The measurements take turns (one call of each per round), so a change of machine load
    during the run hits all of them alike; every call starts after a barrier.
    """
    from mpi4py import MPI          # in the workers only: see _worker
    times = {k: [] for k in fns}
    for i in range(warmup + steps):
        for k, fn in fns.items():
            comm.comm.Barrier()
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    out, rounds = {}, {}
    for k, ts in times.items():
        slowest = np.empty(len(ts))
        comm.comm.Allreduce(np.asarray(ts), slowest, op=MPI.MAX)
        out[k], rounds[k] = float(np.median(slowest)), slowest
    return out, rounds


def _worker(args) -> dict:
    # MPI is initialised here, in the workers, never at import: the driver process that
    # starts them (and torch's spawned DDP workers, which import this module) must not
    from mpidist.collectives import Handle, allreduce_async
    from mpidist.comm import Communicator
    from mpidist.engine.distributed import DistributedOptimizer, make_buckets

    comm = Communicator()
    rng = np.random.default_rng(comm.rank)
    x = rng.normal(size=(args.batch, IN)).astype(np.float32)
    y = rng.integers(0, CLASSES, args.batch)
    model = MLP(IN, CLASSES, hidden=[args.hidden, args.hidden]).no_input_grad()
    layout, params, grads = materialize(model, seed=0)
    ce = SoftmaxCrossEntropy()
    scale = 1.0 / (args.batch * comm.size)

    def fwd_bwd():
        ce.forward(model.forward(x), y)
        model.backward(ce.backward(scale))

    # compute only: the same DistributedOptimizer step with its bucket allreduces left out
    # (forward, backward, the finiteness agreement, the update and the zeroing), so that
    # step - compute is what communication adds and nothing else
    local = DistributedOptimizer(build_optimizer("sgd", layout, lr=0.01, momentum=0.9), params,
                                 grads, comm=comm, algorithm=args.algorithm, op="sum")
    local.allreduce_async = lambda buf: Handle(None)

    def compute():
        local.attach(model)
        fwd_bwd()
        local.step()

    # communication only: the same buckets, launched back to back
    buckets = [grads.data[lo:hi] for lo, hi in make_buckets(layout, 4, args.bucket_mb)]

    def communicate():
        for h in [allreduce_async(b, op="sum", algorithm=args.algorithm, comm=comm) for b in buckets]:
            h.wait()

    # full data-parallel steps, with buckets overlapping backward and with one bucket after it
    dopts = {key: DistributedOptimizer(build_optimizer("sgd", layout, lr=0.01, momentum=0.9), params, grads,
                                       comm=comm, algorithm=args.algorithm, bucket_mb=mb, op="sum")
             for key, mb in (("step", args.bucket_mb), ("step_noov", 0.0))}

    def dp_step(dopt):
        def run():
            dopt.attach(model)
            fwd_bwd()
            dopt.step()
        return run

    res, rounds = _interleaved(comm, {"t_compute": compute, "t_comm": communicate,
                                      "step": dp_step(dopts["step"]),
                                      "step_noov": dp_step(dopts["step_noov"])}, args.steps, args.warmup)
    # the same within each round (its four calls run back to back, so a drift of the
    # machine's speed between rounds cancels), then the median over rounds
    saved = rounds["t_compute"] + rounds["t_comm"] - rounds["step"]
    model.set_grad_hook(None)
    out = {"ranks": comm.size, "params": layout.numel, "batch_per_rank": args.batch, **res,
           "samples_per_s": args.batch * comm.size / res["step"],
           "samples_per_s_noov": args.batch * comm.size / res["step_noov"],
           "hidden_fraction": (res["t_compute"] + res["t_comm"] - res["step"]) / res["t_comm"]
           if res["t_comm"] > 0 else 0.0,
           "hidden_fraction_paired": float(np.median(saved)) / res["t_comm"]
           if res["t_comm"] > 0 else 0.0}
    comm.free()
    return out


# ----------------------------------------------------------------------------- PyTorch DDP peer
def _torch_ddp_worker(rank, size, port, args, queue):
    import torch                        # optional: only for the DDP comparison
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.manual_seed(rank)
    net = torch.nn.Sequential(torch.nn.Linear(IN, args.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(args.hidden, CLASSES))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(args.batch, IN), torch.randint(0, CLASSES, (args.batch,))
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    t = torch.tensor([(time.perf_counter() - t0) / args.steps])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put(args.batch * size / float(t))
    dist.destroy_process_group()


def _torch_ddp(size, args):
    import torch.multiprocessing as mp      # optional: only for the DDP comparison
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_torch_ddp_worker, args=(size, port, args, queue), nprocs=size, join=True,
                       start_method="spawn")
    return queue.get()


def _torch_rates(sizes, args, attempts: int = 2) -> tuple[dict, list[str]]:
    """DDP samples/s per world size; a run that fails (a gloo worker aborted once here, on
    a machine where the next run passed) is tried again, then left out and named."""
    rates, failed = {}, []
    for size in sizes:
        for attempt in range(attempts):
            try:
                rates[size] = _torch_ddp(size, args)
                break
            except Exception as exc:          # the peer's failure must not lose our figures
                if attempt == attempts - 1:
                    failed.append(f"DDP at {size} ranks failed {attempts} times "
                                  f"({type(exc).__name__}: {exc})")
    return rates, failed


# ----------------------------------------------------------------------------- driver
def _run_sizes(args) -> list[dict]:
    rows = []
    for n in [int(r) for r in args.ranks.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result.json")
            argv = [sys.executable, "-m", "mpidist", "bench", "train", "--worker", "--json", path,
                    "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
                    "--hidden", str(args.hidden), "--bucket-mb", str(args.bucket_mb), "--algorithm", args.algorithm]
            proc = run(n, argv, timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"the {n}-rank measurement failed (exit {proc.returncode})")
            with open(path) as fh:
                rows.append(json.load(fh))
    return rows


def _report(rows, args, torch_note, torch_rates) -> str:
    base = rows[0]["samples_per_s"] if rows and rows[0]["ranks"] == 1 else None
    head = (f"{'ranks':>5} {'compute ms':>10} {'comm ms':>8} {'step ms':>8} {'no-overlap ms':>13} "
            f"{'samples/s':>10} {'speed-up':>8} {'hidden':>7} {'paired':>7} {'DDP samples/s':>13}")
    lines = [f"MLP {IN}-{args.hidden}-{args.hidden}-{CLASSES} ({rows[0]['params'] / 1e6:.1f}M params), "
             f"batch {args.batch}/rank, {args.algorithm} allreduce, buckets {args.bucket_mb} MiB, "
             f"{args.steps} timed steps", head, "-" * len(head)]
    for r in rows:
        speed = f"{r['samples_per_s'] / base:.2f}x" if base else "-"
        ddp = torch_rates.get(r["ranks"])
        hidden = f"{r['hidden_fraction'] * 100:.0f}%" if r["ranks"] > 1 else "-"   # nothing to hide on 1 rank
        paired = f"{r['hidden_fraction_paired'] * 100:.0f}%" if r["ranks"] > 1 else "-"
        lines.append(f"{r['ranks']:>5} {r['t_compute'] * 1e3:>10.1f} {r['t_comm'] * 1e3:>8.1f} "
                     f"{r['step'] * 1e3:>8.1f} {r['step_noov'] * 1e3:>13.1f} {r['samples_per_s']:>10.0f} "
                     f"{speed:>8} {hidden:>7} {paired:>7} "
                     f"{(f'{ddp:.0f}' if ddp else '-'):>13}")
    lines.append(torch_note)
    return "\n".join(lines)


def _plot(rows, torch_rates, path):
    import matplotlib                  # slow to import, and only the driver plots
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ranks = [r["ranks"] for r in rows]
    ax[0].plot(ranks, [r["samples_per_s"] for r in rows], "o-", label="mpidist (overlap)")
    ax[0].plot(ranks, [r["samples_per_s_noov"] for r in rows], "s--", label="mpidist (no overlap)")
    if torch_rates:
        ax[0].plot(sorted(torch_rates), [torch_rates[k] for k in sorted(torch_rates)], "^:", label="PyTorch DDP")
    ax[0].set(xlabel="ranks", ylabel="samples/s", title="throughput", xticks=ranks)
    ax[0].legend()
    w = 0.2
    idx = np.arange(len(rows))
    for i, (k, label) in enumerate((("t_compute", "compute"), ("t_comm", "comm"), ("step", "step (overlap)"),
                                    ("step_noov", "step (no overlap)"))):
        ax[1].bar(idx + (i - 1.5) * w, [r[k] * 1e3 for r in rows], w, label=label)
    ax[1].set(xticks=idx, xticklabels=ranks, xlabel="ranks", ylabel="ms", title="time per step")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code.

    Model and data: an MLP 1024-2048-2048-10 (6.3M parameters), synthetic inputs,
    256 samples per rank, momentum SGD, one BLAS thread per rank. At each world size it times:
        compute   the DistributedOptimizer step below with its bucket allreduces left out:
                  forward, backward, finiteness agreement, update, zeroing
        comm      allreduce of the whole gradient buffer in the same buckets, no compute
        step      a DistributedOptimizer step with buckets overlapping backward (--bucket-mb)
        step_noov the same with one bucket sent after backward (no overlap)
    (taking turns, medians over the timed steps of the slowest rank) and reports samples/s
    (global batch / step), speed-up over 1 rank, and the hidden fraction of communication,
    (compute + comm - step) / comm, from the medians ("hidden") and as the median over rounds
    of that round's own difference ("paired": steadier on a machine whose speed drifts).
    When PyTorch is importable the same MLP is trained with DDP (gloo, one thread per rank)
    for comparison; otherwise it says so.
    """
    args = _parse(argv)
    # started by mpiexec/srun itself: measure this world size only (mpiexec can not nest)
    launched = any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
    if args.worker or launched:
        result = _worker(args)
        from mpi4py import MPI          # a worker: MPI is up already (see _worker)
        if MPI.COMM_WORLD.Get_rank() == 0:
            if args.json:
                with open(args.json, "w") as fh:
                    fh.write(json.dumps(result, indent=1))
            else:
                print(_report([result], args, "", {}))
        return 0
    rows = _run_sizes(args)
    torch_rates, torch_note = {}, ""
    if args.no_torch:
        torch_note = "PyTorch DDP comparison skipped (--no-torch)"
    else:
        try:
            import torch  # noqa: F401
        except ImportError:
            torch_note = "PyTorch is not installed in this environment: DDP comparison not run"
        else:
            torch_rates, failed = _torch_rates([r["ranks"] for r in rows], args)
            torch_note = "PyTorch DDP: gloo backend, one thread per rank, same MLP, batch and momentum SGD"
            if failed:
                torch_note += "; " + "; ".join(failed)
    text = _report(rows, args, torch_note, torch_rates)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train.json"), "w") as fh:
        json.dump({"rows": rows, "torch_ddp": torch_rates, "note": torch_note, "args": vars(args)}, fh, indent=1)
    with open(os.path.join(args.out, "train.csv"), "w") as fh:
        keys = list(rows[0])
        fh.write(",".join(keys + ["torch_ddp"]) + "\n")
        for r in rows:
            fh.write(",".join(str(r[k]) for k in keys) + f",{torch_rates.get(r['ranks'], '')}\n")
    with open(os.path.join(args.out, "train.txt"), "w") as fh:
        fh.write(text + "\n")
    _plot(rows, torch_rates, os.path.join(args.out, "train.png"))
    print(f"wrote {args.out}/train.{{json,csv,txt,png}}")
    return 0
