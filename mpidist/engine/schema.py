"""Every job config key: its section, type, default, allowed values and one-line doc.

engine.config validates a job against this table; `mpidist train --show-schema` prints it
(format_schema). The strategy, model, schedule and algorithm choices come from the modules
that implement them, so a new one appears here by itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mpidist.collectives.registry import algorithm_names
from mpidist.engine.strategies import STRATEGIES
from mpidist.nn.models import MODELS
from mpidist.optim.lr_schedules import LR_SCHEDULES
from mpidist.pipeline.schedules import PIPELINE_SCHEDULES
from mpidist.ps.consistency import MODELS as CONSISTENCY_MODELS

__all__ = ["SCHEMA", "Field", "format_schema"]


@dataclass(frozen=True)
class Field:
    """One config key: its type(s), default, allowed values or check, and a one-line doc."""
    types: tuple
    default: Any
    doc: str
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    rule: str = ""              # the check in words, for the error message


def _f(types, default, doc, choices=None, check=None, rule=""):
    return Field(types if isinstance(types, tuple) else (types,), default, doc, choices, check, rule)


_pos = dict(check=lambda v: v > 0, rule="> 0")
_nonneg = dict(check=lambda v: v >= 0, rule=">= 0")
_ints = dict(check=lambda v: all(isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in v),
             rule="a list of positive integers")
_groups = dict(check=lambda v: all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v),
               rule="a list of integers >= 0")
_prob = dict(check=lambda v: 0 <= v < 1, rule="in [0, 1)")

SCHEMA: dict[str, dict[str, Field]] = {
    "job": {
        "name": _f(str, None, "job name (default: the config file's stem)"),
        "seed": _f(int, 0, "seed of model init, data order and dropout", **_nonneg),
        "device": _f(str, "cpu", "where the dp strategy computes: cpu (NumPy) or gpu (CuPy)",
                     choices=("cpu", "gpu")),
        "epochs": _f(int, 1, "passes over the training set (ignored when steps > 0)", **_nonneg),
        "steps": _f(int, 0, "optimizer steps to run; 0 = run `epochs` epochs", **_nonneg),
        "out_dir": _f(str, None, "where metrics, plots and checkpoints go (default runs/<name>)"),
        "eval_every": _f(int, 0, "evaluate every N steps; 0 = at the end of each epoch", **_nonneg),
        "progress": _f(bool, True, "tqdm progress bar on rank 0"),
        "plot": _f(bool, True, "write a PNG plot of the run at the end"),
        "target_accuracy": _f((int, float), 0.0, "fail (exit 1) if final test accuracy is below this",
                              check=lambda v: 0 <= v <= 1, rule="in [0, 1]"),
        "fault_tolerance": _f(str, "off", "shrink: survive a lost rank and continue on the survivors "
                              "(dp, zero 1/2; needs the FT environment, launcher --ft)", choices=("off", "shrink")),
        "shard_restore": _f(str, "neighbour", "zero with fault_tolerance: where a lost rank's shard comes "
                            "from: neighbour (a copy each rank keeps of the next one's) or checkpoint",
                            choices=("neighbour", "checkpoint")),
        "timeout": _f((int, float), None, "seconds a collective may wait before the watchdog ends the "
                      "job with every rank's flight record (default: env MPIDIST_TIMEOUT, else 600; "
                      "0 = never)", **_nonneg),
    },
    "model": {
        "name": _f(str, "mlp", "model", choices=tuple(MODELS)),
        "hidden": _f(list, [256, 256], "mlp: hidden layer sizes", **_ints),
        "activation": _f(str, "relu", "mlp: activation", choices=("relu", "gelu")),
        "channels": _f(list, [16, 32], "cnn: channels of the two conv blocks", **_ints),
        "dim": _f(int, 64, "gpt: embedding width", **_pos),
        "heads": _f(int, 4, "gpt: attention heads (divides dim)", **_pos),
        "layers": _f(int, 2, "gpt: transformer blocks", **_pos),
        "dropout": _f((int, float), 0.0, "mlp/gpt: dropout probability", **_prob),
    },
    "data": {
        "dataset": _f(str, "digits", "digits (scikit-learn, no download) | synthetic | text | hdf5",
                      choices=("digits", "synthetic", "text", "hdf5")),
        "path": _f(str, None, "hdf5: the dataset file; text: the text file (default data/sample.txt)"),
        "cache_dir": _f(str, "runs/data", "where generated HDF5 datasets are written"),
        "batch_size": _f(int, 64, "GLOBAL batch size (split over data-parallel ranks)", **_pos),
        "drop_last": _f(bool, True, "drop the last partial batch of an epoch (else: a short batch)"),
        "shuffle": _f(bool, True, "reshuffle every epoch from the seed (same global order at any world size)"),
        "test_fraction": _f((int, float), 0.2, "digits/synthetic/text: held-out fraction",
                            check=lambda v: 0 < v < 1, rule="in (0, 1)"),
        "samples": _f(int, 8192, "synthetic: number of samples", **_pos),
        "features": _f(int, 64, "synthetic: input features", **_pos),
        "classes": _f(int, 10, "synthetic: classes", check=lambda v: v >= 2, rule=">= 2"),
        "block": _f(int, 64, "text: tokens per sequence", check=lambda v: v >= 2, rule=">= 2"),
    },
    "optim": {
        "name": _f(str, "sgd", "optimizer in mpidist.optim's registry (sgd, adamw, lars, lamb, ...)"),
        "lr": _f((int, float), 0.01, "peak learning rate", **_pos),
        "hyper": _f(dict, {}, "other optimizer arguments, e.g. {momentum = 0.9, weight_decay = 1e-4}"),
        "schedule": _f(str, "constant", "learning-rate schedule after warm-up (mpidist.optim.lr_schedules)",
                       choices=LR_SCHEDULES),
        "warmup_steps": _f(int, 0, "linear warm-up steps from 0 to lr", **_nonneg),
        "end_lr": _f((int, float), 0.0, "final learning rate of cosine/poly decay", **_nonneg),
    },
    "parallel": {
        "strategy": _f(str, "dp", " | ".join(STRATEGIES), choices=tuple(STRATEGIES)),
        "algorithm": _f(str, "auto", "allreduce algorithm (auto: algorithm_table's choice, else "
                        "a built-in rule)", choices=tuple(algorithm_names())),
        "algorithm_table": _f(str, "", "auto's decision table, a file written by `mpidist tune` "
                              "(default: env MPIDIST_ALGORITHM_TABLE, else the built-in rule)"),
        "bucket_mb": _f((int, float), 4.0, "gradient bucket size in MiB (0 = one bucket after backward)", **_nonneg),
        "compression": _f(str, "none", "gradient compressor in mpidist.compress's registry, or none "
                          "(dp, zero, pipeline; powersgd: not zero stages 2, 3)"),
        "compression_options": _f(dict, {}, "options of the compressor, e.g. {ratio = 0.01} (topk), "
                                  "{levels = 15} (qsgd), {rank = 2} (powersgd)"),
        "compression_warmup": _f(int, 0, "first optimizer steps whose gradients go uncompressed "
                                 "(float32)", **_nonneg),
        "compression_allreduce": _f(str, "auto", "how compressed payloads combine: auto (the "
                                    "format's own: gather for topk, sign, qsgd; ring for fp16, "
                                    "bf16; linear for randomk, powersgd) | gather (allgather every "
                                    "payload, exact sum) | ring (re-encoded partial sums, "
                                    "2(p-1)/p payloads sent at any p) | linear",
                                    choices=("auto", "gather", "ring", "linear")),
        "accumulation": _f(int, 1, "micro-steps accumulated per optimizer step", **_pos),
        "stage": _f(int, 1, "zero: ZeRO stage", choices=(1, 2, 3)),
        "dtype": _f(str, "float32", "zero: parameter and gradient dtype (fp32 masters in the optimizer)",
                    choices=("float32", "bfloat16", "float16")),
        "stages": _f(int, 2, "pipeline: pipeline stages (divides the world size)", **_pos),
        "microbatches": _f(int, 4, "pipeline: micro-batches per step", **_pos),
        "schedule": _f(str, "1f1b", "pipeline: schedule (mpidist.pipeline.schedules)",
                       choices=tuple(PIPELINE_SCHEDULES)),
        "recompute": _f(bool, False, "pipeline: recompute activations in backward"),
        "virtual": _f(int, 1, "pipeline: model chunks per rank (schedule = 'interleaved')", **_pos),
        "partition": _f(str, "params", "pipeline: cut the layers by parameter count, measured cost, "
                        "or the explicit cuts", choices=("params", "cost", "cuts")),
        "cuts": _f(list, [], "pipeline: with partition = 'cuts', the layer indices where stages 1, 2, "
                   "... start", **_ints),
        "zero": _f(int, 0, "pipeline: 1 = ZeRO stage 1 within each stage's data-parallel group",
                   choices=(0, 1)),
        "consistency": _f(str, "bsp", "ps: bsp | ssp | asp", choices=CONSISTENCY_MODELS),
        "servers": _f(int, 1, "ps, diloco_async: number of server ranks", **_pos),
        "staleness": _f(int, 0, "ps/ssp: bound on worker clock skew", **_nonneg),
        "straggler": _f((int, float), 0.0, "ps, diloco_async: seconds of delay injected per step on the "
                        "slow worker or group (straggler_mode says which)", **_nonneg),
        "straggler_mode": _f(str, "fixed", "ps, diloco_async: the slow worker (group): fixed = the last "
                             "one at every step; random = one per step, drawn from the job seed "
                             "and the step",
                             choices=("fixed", "random")),
        "rho": _f((int, float), 1.0, "admm: penalty parameter", **_pos),
        "group_size": _f(int, 0, "diloco/local_sgd/diloco_async: ranks per group (data parallel "
                         "inside, outer steps across); 0 = one group per node", **_nonneg),
        "groups": _f(list, [], "diloco/local_sgd: the group of every rank, one number per rank, "
                     "in place of group_size's rule ([] = by group_size; a recovery under "
                     "fault_tolerance = 'shrink' sets it so that survivors keep their groups)", **_groups),
        "sync_every": _f(int, 100, "diloco/local_sgd/diloco_async: inner steps between outer steps "
                         "(H)", **_pos),
        "outer_lr": _f((int, float), 0.7, "diloco, diloco_async: outer learning rate", **_pos),
        "outer_momentum": _f((int, float), 0.9, "diloco, diloco_async: outer Nesterov momentum (0 = "
                              "plain SGD)", **_prob),
        "outer_delay": _f(int, 0, "diloco_async: pushes per delayed Nesterov momentum step (0 = "
                          "the number of groups)", **_nonneg),
        "outer_compression": _f(str, "none", "diloco/local_sgd: compressor of the exchange between "
                                "groups (fp16, bf16, sign, ... of mpidist.compress), or none"),
        "outer_compression_options": _f(dict, {}, "diloco/local_sgd: options of the outer compressor"),
        "outer_fragments": _f(int, 1, "diloco/local_sgd: streaming DiLoCo's fragments of the model, each "
                              "with its outer step on its own offset in every H steps (1 = plain)", **_pos),
    },
    "checkpoint": {
        "interval": _f(int, 0, "save every N steps; 0 = only at the end if dir is set", **_nonneg),
        "dir": _f(str, None, "checkpoint directory (default <out_dir>/checkpoints when interval > 0 or resume)"),
        "keep": _f(int, 2, "checkpoints kept", **_pos),
        "resume": _f(bool, False, "resume from the latest checkpoint in dir"),
    },
}


def format_schema() -> str:
    """The schema as annotated TOML, for --show-schema and the docs."""
    lines = []
    for sec, fields in SCHEMA.items():
        lines.append(f"[{sec}]")
        for key, f in fields.items():
            choice = f" ({' | '.join(map(str, f.choices))})" if f.choices else ""
            lines.append(f"# {f.doc}{choice}")
            lines.append(f"{key} = {_toml_value(f.default)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v) -> str:
    if v is None:
        return '""   # unset'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, dict):
        return "{}"
    return repr(v)
