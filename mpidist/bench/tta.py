"""Time to accuracy (`mpidist bench compress --tta CONFIG`): the training job uncompressed,
for its own epochs (the reference), then once per CONFIGS entry through mpidist.engine for
`budget` times those epochs: final test accuracy, its gap to the reference, and the epoch
and seconds of training at which it first came within WITHIN of the reference. Then
OPTIMIZERS: the job with another optimizer instead of gradient compression.

    python -m mpidist.launcher -n 4 -- mpidist bench compress --numel 1000000 \\
        --tta jobs/digits_lamb.toml
"""
from __future__ import annotations

import json
import math
import os
import re

from mpidist.compress import PowerSGD
from mpidist.compress.sparse import exponential_warmup
from mpidist.data.loader import build_datasets
from mpidist.engine.config import load_config
from mpidist.engine.loop import run as train
from mpidist.flat import Layout
from mpidist.strategy.builders import build_model_from_config

__all__ = ["run", "table", "time_to", "fmt", "CONFIGS", "OPTIMIZERS", "FREEZE", "WITHIN"]

# the time-to-accuracy runs: (label, compressor name, options), error feedback on unless
# a label says no-EF (sign, PowerSGD and the sparsifiers have it by default); warmup =
# "ramp" stands for DGC's exponential ramp 25% -> 6.25% -> 1.5625%, one epoch each, then
# the ratio
CONFIGS = [
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
# ones get freeze_step = freeze_fraction (default FREEZE) of the reference run's steps.
# Random-k 1% releases each coordinate's momentum in bursts ~100 steps apart: on the main
# job it diverged near peak lr after a 20-step warm-up, and trained after 40 to 80 steps
OPTIMIZERS = [
    ("adamw (uncompressed)", "adamw", {}),
    ("onebit_adam sign", "onebit_adam", {"compressor": "sign"}),
    ("onebit_lamb sign", "onebit_lamb", {"compressor": "sign"}),
    ("onebit_lamb randomk 1%", "onebit_lamb", {"compressor": "randomk",
                                               "compressor_options": {"ratio": 0.01},
                                               "freeze_fraction": 0.45}),
]
FREEZE = 0.15
WITHIN = 0.01       # "within": test accuracy at most 1 percentage point below uncompressed


def run(comm, config_path: str, out: str, overrides: dict, budget: float = 1.0) -> dict:
    """Train the job uncompressed, then once per CONFIGS entry for `budget` times its
    epochs: final test accuracy, the gap to uncompressed, and epochs and seconds until
    within WITHIN of the uncompressed final."""
    try:
        rows = {"powersgd plan": _job_plan(comm, config_path, overrides)}
    except Exception as exc:    # the engine's or data's error, agreed on every rank by them
        rows = {"powersgd plan": f"unavailable ({type(exc).__name__}: {exc})"[:200]}
    reference = reference_epochs = steps_per_epoch = None
    runs = [(label, name, opts, None) for label, name, opts in
            [("uncompressed", "none", {})] + CONFIGS] + \
        [(label, "none", {}, (optim, hyper)) for label, optim, hyper in OPTIMIZERS]
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
            summary = train(cfg, comm)
            if reference is None:
                reference, reference_epochs = summary["test_accuracy"], cfg["job"]["epochs"]
                steps_per_epoch = max(1, summary["steps"] // max(reference_epochs, 1))
            epochs, seconds = time_to(os.path.join(job_out, "metrics.jsonl"),
                                       reference - WITHIN, comm)
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
    `hyper`; a 1-bit one freezes after hyper's freeze_fraction, default FREEZE, of the
    reference's steps)."""
    base = dict(load_config(config_path, comm, overrides)["optim"]["hyper"])
    hyper = dict(hyper)
    fraction = hyper.pop("freeze_fraction", FREEZE)
    if optim.startswith("onebit_"):
        base["freeze_step"] = max(1, round(fraction * reference_steps))
    return {"optim.name": optim, "optim.hyper": {**base, **hyper}}


def _job_plan(comm, config_path: str, overrides: dict) -> str:
    """PowerSGD (rank 4)'s plan on the job's own layers: what it compresses, floats sent."""
    cfg = load_config(config_path, comm, overrides)
    train, test, meta = build_datasets(cfg, comm)
    train.close()
    test.close()
    layout = Layout(build_model_from_config(cfg, meta).param_shapes())
    return PowerSGD(rank=4).plan_for(layout, layout.numel).describe()


def time_to(path: str, target: float, comm):
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


def fmt(v, spec: str) -> str:
    width = int(re.match(r"\d*", spec).group() or 0)
    missing = v is None or (isinstance(v, float) and math.isnan(v))
    return f"{'-':>{width}}" if missing else format(v, spec)


def table(config: str, tta: dict, budget: float) -> list[str]:
    """Per compressor: final test accuracy, gap to uncompressed, epochs and seconds until
    within 1 percentage point of uncompressed (- if never)."""
    lines = [f"time to accuracy ({config}; within = test accuracy >= uncompressed - "
             f"{100 * WITHIN:g} pp; compressed runs get {budget:g}x the epochs):"]
    lines.append(f"  {'compressor':<24}{'test %':>8}{'gap pp':>8}{'epochs':>8}"
                 f"{'within at epoch':>17}{'after s':>9}{'train s':>9}")
    for label, r in tta.items():
        if label == "powersgd plan":
            continue
        if "error" in r:
            lines.append(f"  {label:<24}failed: {r['error']}")
            continue
        lines.append(f"  {label:<24}{100 * r['test_accuracy']:8.2f}{r['gap_pp']:+8.2f}"
                     f"{r['epochs']:8d}{fmt(r['epochs_to_within'], '17d')}"
                     f"{fmt(r['seconds_to_within'], '9.1f')}{r['train_s']:9.1f}")
    for label, r in tta.items():
        if isinstance(r, dict) and r.get("options"):
            lines.append(f"  {label}: {json.dumps(r['options'])}")
    if isinstance(tta.get("powersgd plan"), str):
        lines.append(f"  PowerSGD rank 4 on the job's layers: {tta['powersgd plan']}")
    return lines
