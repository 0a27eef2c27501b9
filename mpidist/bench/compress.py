"""`mpidist bench compress`: payload size, bytes each rank sends, kernel throughput and
(optionally) time-to-accuracy of every gradient compressor.

    python -m mpidist.launcher -n 4 -- mpidist bench compress                 # 25M floats
    python -m mpidist.launcher -n 2 -- mpidist bench compress --numel 2000000 --steps 2
    python -m mpidist.launcher -n 4 -- mpidist bench compress --numel 1000000 \\
        --tta jobs/digits_lamb.toml                 # also train the job once per TTA_CONFIGS

Phases:
  1. kernels: rank 0 alone (the others sleep) times each compressor's encode
     on one core, as GB/s of float32 input, next to NumPy baselines (astype(float16),
     argpartition for top-k); the payload ratio is payload bytes / dense float32 bytes.
  2. allreduce: all ranks run the compressed allreduce on their own gradient; bytes are
     the exact bytes each rank sent, against the uncompressed float32 ring's 2(p-1)/p.
     The gathering compressors also run as a ring on re-encoded chunks ("... ring").
     The 1-bit optimizers' momentum exchange (MOMENTUM_VARIANTS: worker and server error
     feedback, mpidist.compress.momentum) runs on the same buffer, as after their warm-up.
  3. time-to-accuracy (--tta CONFIG): the training job uncompressed, for its own epochs
     (the reference), then once per TTA_CONFIGS entry through mpidist.engine with
     --tta-budget times those epochs (default 3; 1 compares at equal epochs): final test
     accuracy, its gap to the reference, and the epoch and seconds of training at which
     it first came within 1 percentage point of the reference. Then TTA_OPTIMIZERS: the
     job with another optimizer instead of gradient compression (AdamW uncompressed, and
     1-bit Adam / 1-bit LAMB freezing after a fraction of the reference's steps).
The gradient is a layout of 6 square layers plus a dense tail (so PowerSGD has matrices).
Writes compress.csv, compress.json and compress.png under --out (rank 0).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import time

import numpy as np

__all__ = ["main", "CONFIGS", "RING_VARIANTS", "MOMENTUM_VARIANTS", "TTA_CONFIGS",
           "TTA_OPTIMIZERS", "bench_layout"]

# (label, compressor name, options)
CONFIGS = [
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("topk 1%", "topk", {"ratio": 0.01}),
    ("topk 1% sampled", "topk", {"ratio": 0.01, "method": "sampled"}),
    ("randomk 1%", "randomk", {"ratio": 0.01}),
    ("sign (1-bit)", "sign", {}),
    ("qsgd 4-bit", "qsgd", {"levels": 7}),
    ("powersgd r4", "powersgd", {"rank": 4}),
]
# the gathering compressors again, as a ring on re-encoded chunks (allreduce phase only)
RING_VARIANTS = [
    ("topk 1% ring", "topk", {"ratio": 0.01}),
    ("sign (1-bit) ring", "sign", {}),
    ("qsgd 4-bit ring", "qsgd", {"levels": 7, "error_feedback": True}),
]

# the 1-bit optimizers' momentum average after their warm-up (allreduce phase only)
MOMENTUM_VARIANTS = [
    ("onebit momentum sign", "sign", {}),
    ("onebit momentum rk 1%", "randomk", {"ratio": 0.01}),
]


def bench_layout(numel: int, layers: int = 6):
    """`layers` square matrices plus a dense tail, numel elements in all."""
    from mpidist.flat import Layout
    side = int(math.isqrt(max(numel // layers, 1)))
    shapes = [(f"layer{i}.weight", (side, side)) for i in range(layers)]
    tail = numel - layers * side * side
    if tail > 0:
        shapes.append(("tail", (tail,)))
    return Layout(shapes)


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _kernels(layout, x, reps: int) -> dict:
    """Rank 0: encode throughput (GB/s of input) and payload ratio per compressor."""
    from mpidist.compress import make_compressor
    gb = x.nbytes / 1e9
    rows = {}
    for label, name, opts in CONFIGS:
        c = make_compressor(name, **opts)
        payload, _ = c.compress(x, layout)                 # JIT cache load, warm start
        t = _best(lambda: c.encode(x, layout), reps)
        rows[label] = {"payload_ratio": c.payload_nbytes(payload) / x.nbytes,
                       "encode_GBps": gb / t, "encode_s": t}
    k = max(1, math.ceil(0.01 * x.size))
    rows["numpy astype(float16)"] = {"encode_GBps": gb / _best(lambda: x.astype(np.float16), reps)}
    rows["numpy argpartition 1%"] = {
        "encode_GBps": gb / _best(lambda: np.argpartition(np.abs(x), x.size - k)[x.size - k:],
                                  reps)}
    return rows


def _allreduce(comm, layout, x, steps: int) -> dict:
    """All ranks: median seconds and max bytes sent per rank of each compressed allreduce."""
    from mpidist.compress import CompressedAllreduce, make_compressor
    from mpidist.compress.allreduce import ring_allreduce_bytes
    p, n = comm.size, x.size
    dense = max(comm.comm.allgather(ring_allreduce_bytes(n, p, comm.rank)))
    rows = {}
    runs = [("dense fp32 ring", "topk", {"ratio": 0.01}, steps + 1, "auto")] + \
        [(label, name, opts, 0, "auto") for label, name, opts in CONFIGS] + \
        [(label, name, opts, 0, "ring") for label, name, opts in RING_VARIANTS]
    for label, name, opts, warmup, algorithm in runs:
        ca = CompressedAllreduce(make_compressor(name, **opts), comm, algorithm=algorithm,
                                 warmup_steps=warmup)
        times, sent = [], 0
        ca(x, layout)                          # untimed: kernel loading, warm starts
        for _ in range(steps):
            comm.comm.Barrier()
            t0 = time.perf_counter()
            ca(x, layout)
            times.append(time.perf_counter() - t0)
            sent = max(sent, ca.bytes_sent)
        t = max(comm.comm.allgather(float(np.median(times))))
        sent = max(comm.comm.allgather(sent))
        rows[label] = {"bytes_sent": sent, "wire_ratio": sent / dense if dense else float("nan"),
                       "allreduce_s": t}
        del ca
    for label, name, opts in MOMENTUM_VARIANTS:
        rows[label] = _momentum(comm, name, opts, x, steps, dense)
    rows["dense fp32 ring"]["dense_ring_bytes"] = dense
    return rows


def _momentum(comm, name: str, opts: dict, x, steps: int, dense: int) -> dict:
    """One 1-bit optimizer step's exchange of x as momentum: worker side (compressed
    reduce-scatter) and server side (compressed allgather), as mpidist.engine.onebit runs it."""
    from mpidist.compress import MomentumAllreduce, make_compressor
    ex = MomentumAllreduce(make_compressor(name, **opts), x.size, comm)
    times, sent = [], 0
    for i in range(steps + 1):               # the first untimed: kernel loading
        comm.comm.Barrier()
        t0 = time.perf_counter()
        ex.allgather(ex.reduce_scatter(x.copy()))
        if i:
            times.append(time.perf_counter() - t0)
            sent = max(sent, ex.bytes_sent)
    t = max(comm.comm.allgather(float(np.median(times))))
    sent = max(comm.comm.allgather(sent))
    return {"bytes_sent": sent, "wire_ratio": sent / dense if dense else float("nan"),
            "allreduce_s": t}


# the time-to-accuracy runs: (label, compressor name, options), error feedback on unless
# a label says no-EF (sign, PowerSGD and the sparsifiers have it by default); warmup =
# "ramp" stands for DGC's exponential ramp 25% -> 6.25% -> 1.5625%, one epoch each, then
# the ratio
TTA_CONFIGS = [
    ("fp16", "fp16", {"error_feedback": True}),
    ("bf16", "bf16", {"error_feedback": True}),
    ("sign (1-bit)", "sign", {}),
    ("qsgd 4-bit", "qsgd", {"levels": 7, "error_feedback": True}),
    ("powersgd r4", "powersgd", {"rank": 4}),
    ("topk 1%", "topk", {"ratio": 0.01}),
    ("topk 1% ramp+clip", "topk", {"ratio": 0.01, "warmup": "ramp", "clip_norm": 1.0}),
    ("topk 1% ramp+clip+mc", "topk", {"ratio": 0.01, "warmup": "ramp", "clip_norm": 1.0,
                                      "momentum": 0.9}),
    ("topk 1% ramp no-EF", "topk", {"ratio": 0.01, "warmup": "ramp", "error_feedback": False}),
    # random-k picks coordinates blindly: at 1% each is sent about 4 times in the job's
    # ~400 steps, whatever error feedback does, so it also runs at 10% and 25%
    ("randomk 1%", "randomk", {"ratio": 0.01}),
    ("randomk 10%", "randomk", {"ratio": 0.1}),
    ("randomk 25%", "randomk", {"ratio": 0.25}),
    ("randomk 1% ramp+clip", "randomk", {"ratio": 0.01, "warmup": "ramp", "clip_norm": 1.0}),
    ("randomk 1% ramp no-EF", "randomk", {"ratio": 0.01, "warmup": "ramp",
                                          "error_feedback": False}),
]
# the time-to-accuracy runs with another optimizer and no gradient compression: (label,
# optimizer, its extra hyperparameters); the job's own [optim] hyper stays, and the 1-bit
# ones get freeze_step = freeze_fraction (default TTA_FREEZE) of the reference run's steps.
# Random-k 1% releases each coordinate's momentum in bursts ~100 steps apart: on the main
# job it diverged near peak lr after a 20-step warm-up, and trained after 40 to 80 steps
TTA_OPTIMIZERS = [
    ("adamw (uncompressed)", "adamw", {}),
    ("onebit_adam sign", "onebit_adam", {"compressor": "sign"}),
    ("onebit_lamb sign", "onebit_lamb", {"compressor": "sign"}),
    ("onebit_lamb randomk 1%", "onebit_lamb", {"compressor": "randomk",
                                               "compressor_options": {"ratio": 0.01},
                                               "freeze_fraction": 0.45}),
]
TTA_FREEZE = 0.15
TTA_WITHIN = 0.01       # "within": test accuracy at most 1 percentage point below uncompressed


def _tta(comm, config_path: str, out: str, overrides: dict, budget: float = 1.0) -> dict:
    """Train the job uncompressed, then once per TTA_CONFIGS entry for `budget` times its
    epochs: final test accuracy, the gap to uncompressed, and epochs and seconds until
    within TTA_WITHIN of the uncompressed final."""
    try:
        from mpidist.compress.sparse import exponential_warmup
        from mpidist.engine.config import load_config
        from mpidist.engine.loop import run
    except ImportError as exc:
        return {"missing": f"mpidist.engine is not usable here ({exc})"}
    try:
        rows = {"powersgd plan": _job_plan(comm, config_path, overrides)}
    except Exception as exc:    # the engine's or data's error, agreed on every rank by them
        rows = {"powersgd plan": f"unavailable ({type(exc).__name__}: {exc})"[:200]}
    reference = reference_epochs = steps_per_epoch = None
    runs = [(label, name, opts, None) for label, name, opts in
            [("uncompressed", "none", {})] + TTA_CONFIGS] + \
        [(label, "none", {}, (optim, hyper)) for label, optim, hyper in TTA_OPTIMIZERS]
    for label, name, opts, optim in runs:
        job_out = os.path.join(out, "tta", re.sub(r"[^\w.%+-]+", "_", label))
        try:
            if opts.get("warmup") == "ramp":
                opts = {**opts, "warmup": exponential_warmup(0.25, opts["ratio"], steps_per_epoch)}
            settings = {"parallel.compression": name, "job.out_dir": job_out,
                        "job.progress": False, "job.plot": False, "job.target_accuracy": 0.0}
            if opts:
                settings["parallel.compression_options"] = opts
            if optim is not None:
                settings.update(_optimizer_settings(comm, config_path, overrides, *optim,
                                                    reference_epochs * steps_per_epoch))
                opts = {"optim": optim[0], **settings["optim.hyper"]}
            if reference is not None:
                settings["job.epochs"] = max(1, round(budget * reference_epochs))
            cfg = load_config(config_path, comm, {**overrides, **settings})
            summary = run(cfg, comm)
            if reference is None:
                reference, reference_epochs = summary["test_accuracy"], cfg["job"]["epochs"]
                steps_per_epoch = max(1, summary["steps"] // max(reference_epochs, 1))
            epochs, seconds = _time_to(os.path.join(job_out, "metrics.jsonl"),
                                       reference - TTA_WITHIN, comm)
            rows[label] = {"options": opts, "test_accuracy": summary["test_accuracy"],
                           "gap_pp": 100 * (summary["test_accuracy"] - reference),
                           "epochs": cfg["job"]["epochs"], "train_s": summary["train_seconds"],
                           "epochs_to_within": epochs, "seconds_to_within": seconds}
        except Exception as exc:      # the engine's error, agreed on every rank by it
            rows[label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            if reference is None:
                break                 # no uncompressed reference: nothing to compare with
    return rows


def _optimizer_settings(comm, config_path: str, overrides: dict, optim: str, hyper: dict,
                        reference_steps: int) -> dict:
    """The overrides that swap the job's optimizer for `optim` (its [optim] hyper kept, plus
    `hyper`; a 1-bit one freezes after hyper's freeze_fraction, default TTA_FREEZE, of the
    reference's steps)."""
    from mpidist.engine.config import load_config
    base = dict(load_config(config_path, comm, overrides)["optim"]["hyper"])
    hyper = dict(hyper)
    fraction = hyper.pop("freeze_fraction", TTA_FREEZE)
    if optim.startswith("onebit_"):
        base["freeze_step"] = max(1, round(fraction * reference_steps))
    return {"optim.name": optim, "optim.hyper": {**base, **hyper}}


def _job_plan(comm, config_path: str, overrides: dict) -> str:
    """PowerSGD (rank 4)'s plan on the job's own layers: what it compresses, floats sent."""
    from mpidist.compress import PowerSGD
    from mpidist.data.loader import build_datasets
    from mpidist.engine.config import load_config
    from mpidist.engine.strategy import build_model_from_config
    from mpidist.flat import Layout
    cfg = load_config(config_path, comm, overrides)
    train, test, meta = build_datasets(cfg, comm)
    train.close()
    test.close()
    layout = Layout(build_model_from_config(cfg, meta).param_shapes())
    return PowerSGD(rank=4).plan_for(layout, layout.numel).describe()


def _time_to(path: str, target: float, comm):
    """(epochs, seconds of training steps) until the first evaluation at >= target, from
    rank 0's log; (None, None) if none got there."""
    result = (None, None)
    if comm.rank == 0 and os.path.exists(path):
        elapsed = 0.0
        with open(path) as fh:
            for line in fh:
                rec = json.loads(line)
                if rec.get("event") == "step":
                    elapsed += rec.get("t_step", 0.0)
                elif rec.get("event") == "eval" and rec.get("accuracy", 0) >= target:
                    result = (rec["epoch"] + 1, elapsed)
                    break
    return comm.comm.bcast(result, root=0)


# the issue's targets: payload ratio at most, and encode GB/s at least (one core)
PAYLOAD_TARGETS = {"fp16": 0.5, "topk 1%": 0.02, "sign (1-bit)": 0.04, "qsgd 4-bit": 0.14}
ENCODE_TARGETS = {"fp16": 1.0, "sign (1-bit)": 1.0, "qsgd 4-bit": 1.0}


def _targets(kernels: dict) -> list[str]:
    """One line per target: the figure, the bound, met or missed."""
    lines = []
    for label, bound in PAYLOAD_TARGETS.items():
        v = kernels[label]["payload_ratio"]
        ok = "met" if round(v, 4) <= bound else "MISSED"    # fp16: 0.5 plus its 4-byte scale
        lines.append(f"  payload {label:<14}{v:8.4f} <= {bound:<6} {ok}")
    for label, bound in ENCODE_TARGETS.items():
        v = kernels[label]["encode_GBps"]
        ok = "met" if v >= bound else "MISSED"
        lines.append(f"  encode  {label:<14}{v:8.2f} >= {bound:<6} {ok} GB/s")
    v, ref = kernels["topk 1%"]["encode_GBps"], kernels["numpy argpartition 1%"]["encode_GBps"]
    ok = "met" if v >= ref else "MISSED"
    lines.append(f"  encode  {'topk 1%':<14}{v:8.2f} >= {ref:<6.2f} {ok} GB/s (numpy argpartition)")
    return lines


def _fmt(v, spec: str) -> str:
    width = int(re.match(r"\d*", spec).group() or 0)
    missing = v is None or (isinstance(v, float) and math.isnan(v))
    return f"{'-':>{width}}" if missing else format(v, spec)


def _table(report: dict) -> str:
    k, a = report["kernels"], report["allreduce"]
    lines = [f"compress bench: {report['numel']} float32 ({report['numel'] * 4 / 1e6:.0f} MB), "
             f"{report['ranks']} ranks; dense ring sends "
             f"{a['dense fp32 ring']['dense_ring_bytes'] / 1e6:.2f} MB per rank",
             f"{'compressor':<24}{'payload':>9}{'encode GB/s':>13}{'sent MB/rank':>14}"
             f"{'vs ring':>9}{'allreduce s':>13}"]
    for label in ["dense fp32 ring"] + [c[0] for c in CONFIGS + RING_VARIANTS +
                                         MOMENTUM_VARIANTS] + \
            ["numpy astype(float16)", "numpy argpartition 1%"]:
        kr, ar = k.get(label, {}), a.get(label, {})
        lines.append(f"{label:<24}{_fmt(kr.get('payload_ratio'), '9.4f')}"
                     f"{_fmt(kr.get('encode_GBps'), '13.2f')}"
                     f"{_fmt(ar.get('bytes_sent', 0) / 1e6 if ar else None, '14.3f')}"
                     f"{_fmt(ar.get('wire_ratio'), '9.4f')}{_fmt(ar.get('allreduce_s'), '13.3f')}")
    lines.append("targets (timings are only meaningful on an idle core):")
    lines += _targets(k)
    tta = report.get("tta")
    if tta:
        lines += _tta_table(report["tta_config"], tta, report.get("tta_budget", 1.0))
    return "\n".join(lines)


def _tta_table(config: str, tta: dict, budget: float) -> list[str]:
    """Per compressor: final test accuracy, gap to uncompressed, epochs and seconds until
    within 1 percentage point of uncompressed (- if never)."""
    lines = [f"time to accuracy ({config}; within = test accuracy >= uncompressed - "
             f"{100 * TTA_WITHIN:g} pp; compressed runs get {budget:g}x the epochs):"]
    if "missing" in tta:
        return lines + ["  " + tta["missing"]]
    lines.append(f"  {'compressor':<24}{'test %':>8}{'gap pp':>8}{'epochs':>8}"
                 f"{'within at epoch':>17}{'after s':>9}{'train s':>9}")
    for label, r in tta.items():
        if label == "powersgd plan":
            continue
        if "error" in r:
            lines.append(f"  {label:<24}failed: {r['error']}")
            continue
        lines.append(f"  {label:<24}{100 * r['test_accuracy']:8.2f}{r['gap_pp']:+8.2f}"
                     f"{r['epochs']:8d}{_fmt(r['epochs_to_within'], '17d')}"
                     f"{_fmt(r['seconds_to_within'], '9.1f')}{r['train_s']:9.1f}")
    for label, r in tta.items():
        if isinstance(r, dict) and r.get("options"):
            lines.append(f"  {label}: {json.dumps(r['options'])}")
    if isinstance(tta.get("powersgd plan"), str):
        lines.append(f"  PowerSGD rank 4 on the job's layers: {tta['powersgd plan']}")
    return lines


def _plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [c[0] for c in CONFIGS]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].barh(labels, [report["allreduce"][lab]["wire_ratio"] for lab in labels])
    axes[0].set_xscale("log")
    axes[0].set_xlabel("bytes sent per rank / uncompressed ring")
    axes[1].barh(labels, [report["kernels"][lab]["encode_GBps"] for lab in labels])
    axes[1].axvline(1.0, color="k", linestyle=":")
    axes[1].set_xlabel("encode GB/s of float32 input, one core")
    fig.suptitle(f"gradient compression: {report['numel']} floats, {report['ranks']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpidist bench compress",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=25_000_000, help="gradient length (25M)")
    parser.add_argument("--steps", type=int, default=3, help="allreduce calls per compressor")
    parser.add_argument("--reps", type=int, default=3, help="kernel timings (best of)")
    parser.add_argument("--tta", metavar="CONFIG", default=None,
                        help="also train this job config once per compressor")
    parser.add_argument("--tta-budget", type=float, default=3.0, metavar="F",
                        help="compressed runs train F times the job's epochs (default 3)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a job config value for --tta (as mpidist train --set)")
    parser.add_argument("--out", default=os.path.join("results", "bench", "compress"))
    args = parser.parse_args(argv)
    if args.numel < 64 or args.steps < 1 or args.reps < 1 or args.tta_budget < 1:
        parser.error("--numel >= 64, --steps >= 1, --reps >= 1 and --tta-budget >= 1")

    from mpidist.comm import Communicator, mpi_library
    comm = Communicator()
    layout = bench_layout(args.numel)
    x = np.random.default_rng(comm.rank).standard_normal(layout.numel).astype(np.float32)
    # 1. kernels, rank 0 alone on its core: the others sleep (a blocking barrier would
    #    spin and take cores from it)
    kernels = _kernels(layout, x, args.reps) if comm.rank == 0 else None
    done = comm.comm.Ibarrier()
    while not done.Test():
        time.sleep(0.01)
    kernels = comm.comm.bcast(kernels, root=0)
    # 2. the compressed allreduce on every rank
    allreduce = _allreduce(comm, layout, x, args.steps)
    del x
    report = {"numel": layout.numel, "ranks": comm.size, "mpi": mpi_library(),
              "kernels": kernels, "allreduce": allreduce}
    # 3. time-to-accuracy through the engine
    if args.tta:
        report["tta_config"] = args.tta
        from mpidist.engine.train import _parse_override
        report["tta_budget"] = args.tta_budget
        report["tta"] = _tta(comm, args.tta, args.out, dict(_parse_override(t) for t in args.set),
                             args.tta_budget)
    if comm.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "compress.json"), "w") as fh:
            json.dump(report, fh, indent=1)
        with open(os.path.join(args.out, "compress.csv"), "w") as fh:
            fh.write("compressor,payload_ratio,encode_GBps,bytes_sent_per_rank,wire_ratio,"
                     "allreduce_s\n")
            for label in ["dense fp32 ring"] + [c[0] for c in CONFIGS + RING_VARIANTS +
                                                 MOMENTUM_VARIANTS]:
                kr, ar = kernels.get(label, {}), allreduce[label]
                fh.write(f"{label},{kr.get('payload_ratio', '')},{kr.get('encode_GBps', '')},"
                         f"{ar['bytes_sent']},{ar['wire_ratio']},{ar['allreduce_s']}\n")
        _plot(report, os.path.join(args.out, "compress.png"))
        print(_table(report), flush=True)
    comm.free()
    return 0
