"""`mpidist bench zero`: per-rank memory and step time of ZeRO stages 1-3 against data parallel.

    python -m mpidist.launcher -n 4 -- mpidist bench zero                 # ~50M parameters
    python -m mpidist.launcher -n 4 -- mpidist bench zero --params 2e6 --steps 3

What it measures, and how: main()'s docstring. See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import ml_dtypes
import numpy as np
from mpi4py import MPI

from mpidist.bench.rows import write_rows
from mpidist.comm import Communicator, mpi_library
from mpidist.engine.distributed import DistributedOptimizer
from mpidist.nn import MLP, SoftmaxCrossEntropy, materialize
from mpidist.optim import build_optimizer
from mpidist.zero import build_zero
from mpidist.zero.memory import InFlight, MemoryReport, nbytes, paper_bytes_per_param

__all__ = ["main"]

BF16 = np.dtype(ml_dtypes.bfloat16)
VARIANTS = ("dp", "zero-1", "zero-2", "zero-3")
TARGET_RATIO = {"zero-1": 1.15, "zero-2": 1.15, "zero-3": 1.6}


def _parse(argv):
    p = argparse.ArgumentParser(prog="mpidist bench zero", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=50e6, help="model size in parameters")
    p.add_argument("--layers", type=int, default=8, help="square linear layers")
    p.add_argument("--batch", type=int, default=16, help="samples per rank")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--bucket-mb", type=float, default=8.0, help="gradient bucket size")
    p.add_argument("--budget", type=float, default=10.0,
                   help="per-rank memory budget, in bytes per parameter of the model")
    p.add_argument("--variants", default=",".join(VARIANTS), help="subset of " + ",".join(VARIANTS))
    p.add_argument("--out", default=os.path.join("results", "bench", "zero"),
                   help="output directory")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    if args.layers < 1 or args.params < args.layers or args.steps < 1 or args.batch < 1:
        p.error("--layers, --params, --steps and --batch must be positive (params >= layers)")
    return args


def _model(args):
    width = max(2, int(round(math.sqrt(args.params / args.layers))))
    return MLP(width, width, hidden=(width,) * (args.layers - 1)), width


def _make_optimizer(layout, offset, count, dtype):
    return build_optimizer("adamw", layout, lr=1e-4, weight_decay=0.01, offset=offset,
                           count=count, param_dtype=dtype)


class _DataParallel:
    """The baseline: whole bf16 model everywhere, DistributedOptimizer with fp32 masters."""

    def __init__(self, args, comm):
        self.model, _ = _model(args)
        self.layout, self.params, self.grads = materialize(self.model, dtype=BF16, seed=0)
        opt = _make_optimizer(self.layout, 0, self.layout.numel, BF16)
        self.dopt = DistributedOptimizer(opt, self.params, self.grads, comm=comm, algorithm="ring",
                                         bucket_mb=args.bucket_mb, op="sum", broadcast=False)
        self.dopt.attach(self.model)
        self.loss, self.comm, self.inflight = SoftmaxCrossEntropy(), comm, InFlight()

    def train_step(self, x, y, global_count):
        self.loss.forward(self.model.forward(x), y)
        self.model.backward(self.loss.backward(1.0 / global_count))
        self.dopt.step()

    def memory_report(self):
        opt = self.dopt.optimizer
        n = self.layout.numel
        return MemoryReport(0, self.comm.rank, self.comm.size, n, n, nbytes(self.params.data),
                            nbytes(self.grads.data), nbytes(*opt.state_buffers().values()),
                            nbytes(getattr(opt, "_gscratch", None)), 0, 0)


def _build(variant, args, comm):
    if variant == "dp":
        return _DataParallel(args, comm)
    model, _ = _model(args)
    return build_zero(int(variant[-1]), model, _make_optimizer, comm=comm, dtype=BF16, seed=0,
                      bucket_mb=args.bucket_mb)


def _run(variant, args, comm, x, y):
    """(median step seconds of the slowest rank, this rank's memory report after the steps)."""
    eng = _build(variant, args, comm)
    times = []
    for i in range(args.warmup + args.steps):
        comm.comm.Barrier()
        t = time.perf_counter()
        eng.train_step(x, y, global_count=args.batch * comm.size)
        dt = comm.comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
        if i >= args.warmup:
            times.append(dt)
    rep = eng.memory_report()
    del eng
    return float(np.median(times)), rep


def _peak(rep) -> int:
    return rep.model_states + rep.workspace + rep.peak_in_flight


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code.

    Model: an MLP of --layers square layers (width from --params), bf16 parameters and
    gradients, AdamW with fp32 master weights and moments (mixed-precision Adam: 16 bytes per
    parameter in data parallel), fp32 activations and inputs (NumPy multiplies bf16 weights in
    fp32), --batch synthetic samples per rank.

      1. for dp (DistributedOptimizer, bucketed ring allreduce overlapping backward), zero-1,
         zero-2 and zero-3 in turn: build, --warmup untimed steps, --steps timed steps. Step time
         is the slowest rank's, median over the steps; memory is what each rank's buffers hold
         (.nbytes), compared with the ZeRO paper's formulas (16, 4 + 12/N, 2 + 14/N, 16/N
         bytes per parameter).
      2. budget: a per-rank budget in bytes per parameter of this model (--budget, default 10)
         that data parallel's model states alone exceed; every variant's measured peak (model
         states + work buffers + buffers in flight) is held against it, with the largest model
         each would fit; zero-3 trains under it (its peak is measured while it trains).
    Writes zero.csv, zero.json and zero.png under --out (rank 0).
    """

    args = _parse(argv)
    comm = Communicator()
    n = comm.size
    _, width = _model(args)
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((args.batch, width), dtype=np.float32)
    y = rng.integers(0, width, args.batch)
    rows = []
    for variant in args.variants:
        step, rep = _run(variant, args, comm, x, y)
        stage = 0 if variant == "dp" else int(variant[-1])
        reps = comm.comm.gather(rep, root=0)
        if comm.rank == 0:
            paper = paper_bytes_per_param(stage, n)
            worst = max(reps, key=lambda r: abs(r.bytes_per_param - paper))
            rows.append({"variant": variant, "ranks": n, "params": rep.numel, "step_s": step,
                         "bytes_per_param": worst.bytes_per_param, "paper_bytes_per_param": paper,
                         "memory_error": worst.bytes_per_param / paper - 1,
                         "model_state_mib": max(r.model_states for r in reps) / 2**20,
                         "workspace_mib": max(r.workspace for r in reps) / 2**20,
                         "peak_in_flight_mib": max(r.peak_in_flight for r in reps) / 2**20,
                         "peak_mib": max(_peak(r) for r in reps) / 2**20})
    if comm.rank != 0:
        comm.free()
        return 0

    dp = next((r for r in rows if r["variant"] == "dp"), None)
    budget = args.budget * rows[0]["params"]
    for r in rows:
        r["vs_dp"] = r["step_s"] / dp["step_s"] if dp else float("nan")
        r["fits_budget"] = r["peak_mib"] * 2**20 <= budget
        r["max_params_in_budget"] = int(budget / (r["peak_mib"] * 2**20 / r["params"]))
    print(f"mpidist bench zero: {mpi_library()}, {n} ranks, {rows[0]['params'] / 1e6:.1f}M params "
          f"({args.layers} layers of {width}), bf16 params + AdamW fp32 masters, batch "
          f"{args.batch}/rank")
    head = (f"{'variant':8} {'step s':>8} {'vs dp':>6} {'B/param':>8} {'paper':>7} {'err':>7} "
            f"{'states MiB':>10} {'work MiB':>9} {'flight MiB':>10} {'peak MiB':>9} "
            f"{'fits':>5} {'max params':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['variant']:8} {r['step_s']:8.3f} {r['vs_dp']:6.2f} {r['bytes_per_param']:8.3f} "
              f"{r['paper_bytes_per_param']:7.3f} {100 * r['memory_error']:6.2f}% "
              f"{r['model_state_mib']:10.1f} {r['workspace_mib']:9.1f} "
              f"{r['peak_in_flight_mib']:10.1f} {r['peak_mib']:9.1f} "
              f"{'yes' if r['fits_budget'] else 'no':>5} {r['max_params_in_budget'] / 1e6:10.1f}M")
    print(f"budget: {budget / 2**20:.1f} MiB per rank ({args.budget:g} B/param of this model)")
    for r in rows:
        goal = TARGET_RATIO.get(r["variant"])
        if goal is not None and dp is not None:
            print(f"  {r['variant']}: step {r['vs_dp']:.2f}x dp (target <= {goal}x): "
                  f"{'met' if r['vs_dp'] <= goal else 'NOT met'}; memory within 5% of the "
                  f"formula: {'yes' if abs(r['memory_error']) <= 0.05 else 'NO'}")
    z3 = next((r for r in rows if r["variant"] == "zero-3"), None)
    if dp is not None and z3 is not None:
        print(f"  dp {'fits' if dp['fits_budget'] else 'does not fit'} the budget; zero-3 "
              f"{'trained under it' if z3['fits_budget'] else 'did NOT fit'} (peak "
              f"{z3['peak_mib']:.1f} MiB); largest model in budget: dp "
              f"{dp['max_params_in_budget'] / 1e6:.1f}M, zero-3 "
              f"{z3['max_params_in_budget'] / 1e6:.1f}M "
              f"({z3['max_params_in_budget'] / dp['max_params_in_budget']:.2f}x with work "
              f"buffers and buffers in flight; {dp['bytes_per_param'] / z3['bytes_per_param']:.2f}x "
              f"counting model states alone, N = {n})")
    _write(args.out, rows, args, n)
    comm.free()
    return 0


def _write(out, rows, args, n) -> None:
    write_rows(out, "zero", rows, {"args": vars(args), "ranks": n})
    import matplotlib                  # slow to import, and only rank 0 plots
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["variant"] for r in rows]
    a.bar(names, [r["bytes_per_param"] for r in rows], label="measured")
    a.plot(names, [r["paper_bytes_per_param"] for r in rows], "k_", markersize=30, label="formula")
    a.set_ylabel("model-state bytes per parameter, per rank")
    a.set_title(f"memory on {n} ranks")
    a.legend()
    b.bar(names, [r["step_s"] for r in rows])
    b.set_ylabel("step time (s), slowest rank")
    b.set_title("step time")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "zero.png"), dpi=100)
    plt.close(fig)
