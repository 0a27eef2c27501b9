"""`mpidist bench pipeline`: the measured bubble and activation memory of the pipeline
schedules on uniform stages, against the ideal bubble (p - 1) / (m + p - 1).

    python -m mpidist.launcher -n 4 -- mpidist bench pipeline --stages 2,4 --microbatches 4,8,16
    python -m mpidist.launcher -n 2 -- mpidist bench pipeline --schedules gpipe,1f1b,interleaved
    python -m mpidist.launcher -n 4 -- mpidist bench pipeline --compute timed

Each stage is `--layers` blocks of Linear(dim, dim) + ReLU (real matmuls), or with
`--compute timed` fixed-length waits that need no core (p = 4 on 2 cores). For each
schedule, p and m: one warm-up step, then --steps steps, medians reported. Writes
pipeline.csv, pipeline.json and one timeline PNG per run under --out (rank 0). What each
column means: docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import ctypes
import csv
import json
import os
import time

import numpy as np
from mpi4py import MPI

from mpidist.bench.steadiness import Steadiness
from mpidist.comm import Communicator
from mpidist.nn import Linear, Module, ReLU, Sequential
from mpidist.pipeline.executor import PipelineExecutor
from mpidist.pipeline.schedules import PIPELINE_SCHEDULES, build_schedule, ideal_bubble
from mpidist.pipeline.stage import local_stages, materialize_stages, pipeline_layers
from mpidist.pipeline.timing import gather_events, plot_timeline, replay, summarize
from mpidist.sizes import positive_ints

__all__ = ["main"]

TARGET = 0.15


def _parse(argv):
    p = argparse.ArgumentParser(prog="mpidist bench pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", default="gpipe,1f1b",
                   help=f"schedules to run, of {','.join(PIPELINE_SCHEDULES)} (default gpipe,1f1b)")
    p.add_argument("--stages", type=positive_ints, default=[2, 4], help="pipeline sizes p (default 2,4)")
    p.add_argument("--microbatches", type=positive_ints, default=[4, 8, 16],
                   help="micro-batch counts m (default 4,8,16)")
    p.add_argument("--virtual", type=int, default=2, help="chunks per rank for 'interleaved'")
    p.add_argument("--dim", type=int, default=1024, help="width of the Linear layers (default 1024)")
    p.add_argument("--rows", type=int, default=64, help="rows per micro-batch (default 64)")
    p.add_argument("--layers", type=int, default=2, help="Linear+ReLU blocks per stage (default 2)")
    p.add_argument("--compute", choices=("matmul", "timed"), default="matmul",
                   help="stage work: real matmuls (default) or fixed-length waits")
    p.add_argument("--forward-ms", type=float, default=4.0,
                   help="with --compute timed: one stage's forward of a micro-batch, in ms "
                        "(backward twice that; default 4)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per run (default 3)")
    p.add_argument("--recompute", action="store_true", help="recompute activations in backward")
    p.add_argument("--out", default=os.path.join("results", "bench", "pipeline"),
                   help="output directory (default results/bench/pipeline)")
    args = p.parse_args(argv)
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    for s in args.schedules:
        if s not in PIPELINE_SCHEDULES:
            p.error(f"unknown schedule {s!r}; choose from {', '.join(PIPELINE_SCHEDULES)}")
    for what in ("virtual", "dim", "rows", "layers", "steps"):
        if getattr(args, what) < 1:
            p.error(f"--{what} must be >= 1")
    if not args.forward_ms > 0:
        p.error("--forward-ms must be > 0")
    if "interleaved" in args.schedules and args.layers % args.virtual:
        p.error(f"--layers {args.layers} must split into --virtual {args.virtual} chunks per rank")
    return args


def _uniform_model(stages: int, layers: int, args):
    """stages x layers blocks, every stage the same work: Linear(dim, dim) + ReLU, or
    with --compute timed two waits that make up the stage's --forward-ms."""
    blocks, names = [], []
    for i in range(stages * layers):
        if args.compute == "timed":
            blocks += [_Timed(args.forward_ms / (2 * layers)) for _ in range(2)]
        else:
            blocks += [Linear(args.dim, args.dim), ReLU()]
        names += [f"fc{i}", f"relu{i}"]
    return Sequential(*blocks, names=names)


class _Timed(Module):
    """Takes exactly `ms` in forward and 2 * `ms` in backward, a copy of its input included:
    a layer of known, repeatable cost that leaves the cores free while it waits."""

    def __init__(self, ms: float):
        super().__init__()
        self.seconds = ms / 1e3

    def forward(self, x, train=True):
        end = time.perf_counter() + self.seconds
        self._x = x
        y = x.copy()
        _wait_until(end)
        return y

    def backward(self, dy):
        end = time.perf_counter() + 2 * self.seconds
        dx = dy.copy()
        _wait_until(end)
        return dx


SPIN_SECONDS = 2e-4


def _wait_until(end: float) -> None:
    """Sleep until SPIN_SECONDS before `end`, then spin: a sleep wakes late by the timer
    slack plus the scheduler's latency, by a different amount each time."""
    left = end - time.perf_counter()
    if left > SPIN_SECONDS:
        time.sleep(left - SPIN_SECONDS)
    while time.perf_counter() < end:
        pass


def _fine_timer_slack() -> None:
    """Ask Linux for 1 us of timer slack (prctl PR_SET_TIMERSLACK; default 50 us), so the
    timed layers' sleeps end close to when they are asked to. Elsewhere: nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class _HalfSquare:
    """loss = 0.5 * sum(y^2): a loss that costs one pass over the output, so the last stage
    does the same work as the others (a softmax over `dim` classes would not)."""

    def forward(self, out, targets):
        self._out = out
        return 0.5 * float((out * out).sum()), 0

    def backward(self, scale: float = 1.0):
        out, self._out = self._out, None
        return out * out.dtype.type(scale)


def _run(comm, name: str, p: int, m: int, args) -> tuple[dict, list | None]:
    """One configuration on the pipeline communicator `comm` (p ranks)."""

    v = args.virtual if name == "interleaved" else 1
    model = _uniform_model(p * v, args.layers // v, args)    # same work per rank
    layers = pipeline_layers(model)
    per = 2 * (args.layers // v)
    bounds = list(range(0, len(layers) + 1, per))
    stages = local_stages(layers, bounds, p, comm.rank)
    _, _, grads = materialize_stages(model, stages, dtype=np.float32, seed=0)
    executor = PipelineExecutor(build_schedule(name, p, m, v), stages, comm,
                                loss=_HalfSquare(), recompute=args.recompute)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m * args.rows, args.dim)).astype(np.float32)
    y = np.zeros(m * args.rows)                   # unused by the loss
    runs = []
    for step in range(1 + args.steps):
        grads.data[...] = 0
        stats = executor.run(x, y)
        if step:
            runs.append((summarize(stats, comm), stats))
    order = np.argsort([s["bubble"] for s, _ in runs])
    summary, stats = runs[order[len(order) // 2]]           # the median step
    ideal = ideal_bubble(p, m, v)
    row = {"schedule": name, "p": p, "m": m, "virtual": v, "recompute": args.recompute,
           "ideal_bubble": ideal, "bubble": summary["bubble"],
           "rel_err": abs(summary["bubble"] - ideal) / ideal,
           "bubble_busiest": summary["bubble_busiest"],
           "rel_err_busiest": abs(summary["bubble_busiest"] - ideal) / ideal,
           "bubble_steps": [s["bubble"] for s, _ in runs],
           "step_ms": 1e3 * summary["makespan"],
           "busy_ms": [1e3 * b for b in summary["busy"]],
           "peak_in_flight": summary["peak_in_flight"],
           "peak_microbatches": max(summary["peak_microbatches"]) / v,
           "peak_activation_mib": max(summary["peak_stash_bytes"]) / 2**20}
    events = gather_events(stats, comm)
    if events is not None:
        row["replay_bubble"] = replay(events)["bubble"]
        # the executor's and transfers' idle time per compute action (2 m v per rank)
        row["executor_us_per_action"] = (1e6 * (row["bubble"] - row["replay_bubble"])
                                         * summary["makespan"] / (2 * m * v))
    return row, events


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code."""

    args = _parse(argv)
    if args.compute == "timed":
        _fine_timer_slack()
    world = Communicator()
    root = world.rank == 0
    rows = []
    if root:
        os.makedirs(args.out, exist_ok=True)
        work = f"{args.layers} x Linear({args.dim}, {args.dim}) + ReLU"
        if args.compute == "timed":
            work = (f"timed waits of {args.forward_ms:g} ms forward, "
                    f"{2 * args.forward_ms:g} ms backward")
        print(f"# mpidist bench pipeline: {world.size} ranks, stages of {work}, {args.rows} rows "
              f"per micro-batch, median of {args.steps} steps"
              f"{', recompute' if args.recompute else ''}")
        print(f"{'schedule':<12}{'p':>3}{'m':>4}{'ideal':>8}{'replay':>8}{'bubble':>8}{'err':>9}  "
              f"{'ok':<4}{'busiest':>8}{'err':>8}{'step ms':>9}{'us/act':>8}{'peak mb':>9}"
              f"{'peak MiB':>10}  in flight per rank")
    for p in args.stages:
        if p > world.size:
            if root:
                print(f"# p = {p} skipped: needs {p} ranks, this job has {world.size}")
            continue
        # the first p ranks form the pipeline; the rest sleep in the barrier below
        sub = world.comm.Split(0 if world.rank < p else MPI.UNDEFINED, world.rank)
        if sub != MPI.COMM_NULL:
            comm = Communicator(sub)
            steadiness = Steadiness(sub)
            for name in args.schedules:
                for m in args.microbatches:
                    steadiness.sample()
                    row, events = _run(comm, name, p, m, args)
                    if root:
                        rows.append(row)
                        _print(row)
                        png = os.path.join(args.out, f"timeline_{name}_p{p}_m{m}.png")
                        plot_timeline(events, png, f"{name}: p={p}, m={m}, measured bubble "
                                      f"{row['bubble']:.3f} (ideal {row['ideal_bubble']:.3f})",
                                      virtual=row["virtual"], pp=p)
            steadiness.sample()
            if root:
                print(f"# p = {p}: {steadiness.line()}", flush=True)
            comm.free()
            sub.Free()
        _idle_barrier(world.comm)
    if root:
        _write(rows, args.out)
        print(f"# wrote {os.path.join(args.out, 'pipeline.csv')}, pipeline.json and timeline PNGs")
    world.free()
    return 0


def _idle_barrier(comm) -> None:
    """A barrier that sleeps instead of polling, so ranks left out of a smaller pipeline
    do not take cores from the ranks being timed."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


def _print(row: dict) -> None:
    ok = "yes" if row["rel_err"] <= TARGET else "NO"
    if row["schedule"] == "interleaved":
        ok = "-"                          # the 15% target is for GPipe and 1F1B
    flights = ",".join(str(f) for f in row["peak_in_flight"])
    print(f"{row['schedule']:<12}{row['p']:>3}{row['m']:>4}{row['ideal_bubble']:>8.3f}"
          f"{row['replay_bubble']:>8.3f}{row['bubble']:>8.3f}{100 * row['rel_err']:>8.1f}%  {ok:<4}"
          f"{row['bubble_busiest']:>8.3f}{100 * row['rel_err_busiest']:>7.1f}%{row['step_ms']:>9.1f}"
          f"{row['executor_us_per_action']:>8.0f}"
          f"{row['peak_microbatches']:>9.2f}{row['peak_activation_mib']:>10.2f}  {flights}",
          flush=True)


def _write(rows: list[dict], out: str) -> None:
    with open(os.path.join(out, "pipeline.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    keys = ["schedule", "p", "m", "virtual", "recompute", "ideal_bubble", "replay_bubble",
            "bubble", "rel_err", "bubble_busiest", "rel_err_busiest",
            "step_ms", "executor_us_per_action", "peak_microbatches", "peak_activation_mib"]
    with open(os.path.join(out, "pipeline.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(keys + ["peak_in_flight"])
        for r in rows:
            w.writerow([r[k] for k in keys] + [" ".join(map(str, r["peak_in_flight"]))])
