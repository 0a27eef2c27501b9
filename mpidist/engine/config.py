"""The job config: TOML schema, defaults and validation.

`validate(raw)` checks the WHOLE document and returns a plain nested dict with every key of
every section present (defaults filled in), or raises ConfigError listing every problem at
once. `load_config(path, comm)` runs it on rank 0 only and broadcasts the result, so a bad
config gives the same one message on every rank and no rank starts work.

Sections and keys are the SCHEMA table below; `mpidist train --show-schema` prints it.
"""
from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass
from typing import Any, Callable

from mpidist.collectives.registry import algorithm_names
from mpidist.collectives.select import load_table
from mpidist.errors import ConfigError
from mpidist.nn.models import MODELS
from mpidist.optim.lr_schedules import LR_SCHEDULES
from mpidist.pipeline.schedules import PIPELINE_SCHEDULES
from mpidist.ps.consistency import MODELS as CONSISTENCY_MODELS

__all__ = ["SCHEMA", "Field", "validate", "load_config", "load_toml", "format_schema", "STRATEGY_KEYS", "MODEL_KEYS",
           "support_errors", "check_support"]


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
        "strategy": _f(str, "dp", "dp | zero | pipeline | ps | admm",
                       choices=("dp", "zero", "pipeline", "ps", "admm")),
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
        "servers": _f(int, 1, "ps: number of server ranks", **_pos),
        "staleness": _f(int, 0, "ps/ssp: bound on worker clock skew", **_nonneg),
        "straggler": _f((int, float), 0.0, "ps: seconds of delay injected per step on the slow worker "
                        "(straggler_mode says which)", **_nonneg),
        "straggler_mode": _f(str, "fixed", "ps: the slow worker: fixed = the last worker at every step; "
                             "random = one worker per step, drawn from the job seed and the step",
                             choices=("fixed", "random")),
        "rho": _f((int, float), 1.0, "admm: penalty parameter", **_pos),
    },
    "checkpoint": {
        "interval": _f(int, 0, "save every N steps; 0 = only at the end if dir is set", **_nonneg),
        "dir": _f(str, None, "checkpoint directory (default <out_dir>/checkpoints when interval > 0 or resume)"),
        "keep": _f(int, 2, "checkpoints kept", **_pos),
        "resume": _f(bool, False, "resume from the latest checkpoint in dir"),
    },
}

# [parallel] keys that only mean something for one strategy: set elsewhere -> an error.
STRATEGY_KEYS = {
    "zero": ("stage", "dtype"),
    "pipeline": ("stages", "microbatches", "schedule", "recompute", "virtual", "partition", "cuts",
                 "zero"),
    "ps": ("consistency", "servers", "staleness", "straggler", "straggler_mode"),
    "admm": ("rho",),
}
MODEL_KEYS = {"mlp": ("hidden", "activation", "dropout"), "cnn": ("channels",),
               "gpt": ("dim", "heads", "layers", "dropout")}


def _type_name(types) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "a table"}
    if int in types and float in types:
        return "a number"
    return " or ".join(names.get(t, t.__name__) for t in types)


def _type_ok(value, types) -> bool:
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _unknown(what: str, key: str, known) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {what} {key!r}{hint}; valid: {', '.join(sorted(known))}"


def validate(raw: dict, *, name: str = "job", world_size: int | None = None) -> dict:
    """Check every section and key; return the full config with defaults, or raise ConfigError."""
    errors: list[str] = []
    cfg: dict = {}
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a TOML table")
    for sec in raw:
        if sec not in SCHEMA:
            errors.append(_unknown("section", f"[{sec}]", [f"[{s}]" for s in SCHEMA]))
        elif not isinstance(raw[sec], dict):
            errors.append(f"[{sec}] must be a table")
    given_keys: dict[str, set] = {}
    for sec, fields in SCHEMA.items():
        given = raw.get(sec, {}) if isinstance(raw.get(sec, {}), dict) else {}
        given_keys[sec] = set(given)
        out = {}
        for key in given:
            if key not in fields:
                errors.append(f"[{sec}] " + _unknown("key", key, fields))
        for key, f in fields.items():
            v = given.get(key, f.default)
            if key in given:
                if not _type_ok(v, f.types):
                    errors.append(f"[{sec}] {key} = {v!r}: must be {_type_name(f.types)}")
                elif f.choices is not None and v not in f.choices:
                    errors.append(f"[{sec}] {key} = {v!r}: choose one of {', '.join(map(repr, f.choices))}")
                elif f.check is not None and not f.check(v):
                    errors.append(f"[{sec}] {key} = {v!r}: must be {f.rule}")
            out[key] = float(v) if float in f.types and isinstance(v, int) and not isinstance(v, bool) else v
        cfg[sec] = out

    # cross-key rules
    strategy = cfg["parallel"]["strategy"]
    for strat, keys in STRATEGY_KEYS.items():
        for key in keys:
            if key in given_keys["parallel"] and strat != strategy:
                errors.append(f"[parallel] {key} applies to strategy = {strat!r} only (this job uses {strategy!r})")
    model = cfg["model"]["name"]
    for key in given_keys["model"] - {"name"}:
        if key in SCHEMA["model"] and key not in MODEL_KEYS.get(model, ()):
            errors.append(f"[model] {key} does not apply to model {model!r} (it takes {', '.join(MODEL_KEYS[model])})")
    ds = cfg["data"]["dataset"]
    if (model == "gpt" and ds not in ("text", "hdf5")) or (model != "gpt" and ds == "text"):
        errors.append(f"[model] name = {model!r} does not fit [data] dataset = {ds!r} "
                      "(the gpt model trains on dataset = 'text' or an LM 'hdf5' file; mlp/cnn on the others)")
    if cfg["parallel"]["algorithm_table"]:
        try:
            load_table(cfg["parallel"]["algorithm_table"])
        except ValueError as exc:
            errors.append(f"[parallel] algorithm_table: {exc}")
    if ds == "hdf5" and not cfg["data"]["path"]:
        errors.append("[data] dataset = 'hdf5' needs path = '<file>.h5'")
    if ds in ("hdf5", "text") and cfg["data"]["path"] and not os.path.exists(cfg["data"]["path"]):
        errors.append(f"[data] path = {cfg['data']['path']!r}: no such file")
    if model == "gpt" and cfg["model"]["dim"] % cfg["model"]["heads"]:
        errors.append(f"[model] dim = {cfg['model']['dim']} must be divisible by heads = {cfg['model']['heads']}")
    if cfg["job"]["device"] == "gpu":
        from mpidist.kernels.backend import gpu_available
        if not gpu_available():
            errors.append("[job] device = 'gpu' needs CuPy and a CUDA GPU on this machine")
    if cfg["job"]["epochs"] == 0 and cfg["job"]["steps"] == 0:
        errors.append("[job] set epochs > 0 or steps > 0")
    if world_size is not None:
        if strategy == "pipeline" and world_size % cfg["parallel"]["stages"]:
            errors.append(f"[parallel] stages = {cfg['parallel']['stages']} must divide the {world_size} ranks")
        if strategy == "ps" and cfg["parallel"]["servers"] >= world_size:
            errors.append(f"[parallel] servers = {cfg['parallel']['servers']} leaves no worker among {world_size} ranks")
    if cfg["parallel"]["compression"] != "none":
        found = _check_registry("mpidist.compress", "compressor", cfg["parallel"]["compression"],
                                "[parallel] compression")
        errors += found or _check_compressor(cfg["parallel"])
    else:
        errors += [f"[parallel] {key} needs compression = '<name>'"
                   for key in ("compression_options", "compression_warmup", "compression_allreduce")
                   if key in given_keys["parallel"]]
    errors += support_errors(cfg["parallel"])
    errors += _fault_tolerance_errors(cfg, given_keys["job"])
    found = _check_optimizer(cfg["optim"])
    errors += found or _check_momentum(cfg)
    if not found:       # a 1-bit optimizer: its momentum compressor and where it can run
        from mpidist.engine.onebit import config_errors
        errors += config_errors(cfg)
    if not errors:
        errors += _check_model(cfg)

    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    cfg["job"]["name"] = cfg["job"]["name"] or name
    cfg["job"]["out_dir"] = cfg["job"]["out_dir"] or os.path.join("runs", cfg["job"]["name"])
    if (cfg["checkpoint"]["interval"] > 0 or cfg["checkpoint"]["resume"]) and not cfg["checkpoint"]["dir"]:
        cfg["checkpoint"]["dir"] = os.path.join(cfg["job"]["out_dir"], "checkpoints")
    if ds == "text" and not cfg["data"]["path"]:
        cfg["data"]["path"] = default_text_path()
    return cfg


def default_text_path() -> str:
    """The sample text shipped in the repository's data/ directory."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "data", "sample.txt")


def _check_registry(module: str, what: str, name: str, where: str) -> list[str]:
    import importlib
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return [f"{where} = {name!r}: {module} is not available in this installation"]
    registry = getattr(mod, "COMPRESSORS", None)
    if registry is not None and name not in registry:
        return [f"{where} = {name!r}: unknown {what}; choose one of {', '.join(sorted(registry))}"]
    return []


def _check_compressor(p: dict) -> list[str]:
    """Build the compressor once with its options: a bad option fails here, not mid-run."""
    from mpidist.compress import make_compressor
    if not isinstance(p["compression_options"], dict):
        return []
    try:
        c = make_compressor(p["compression"], **p["compression_options"])
    except (TypeError, ValueError) as exc:
        return [f"[parallel] compression_options: {exc}"]
    algorithm = p["compression_allreduce"]
    try:
        c.check_algorithm(c.aggregation if algorithm == "auto" else algorithm)
    except ValueError as exc:
        return [f"[parallel] compression_allreduce = {algorithm!r}: {exc}"]
    return []


def _check_momentum(cfg: dict) -> list[str]:
    """Momentum correction (compression_options.momentum) replaces the optimizer's own
    momentum (SGD, LARS): both at once would apply momentum twice."""
    p, o = cfg["parallel"], cfg["optim"]
    options = p["compression_options"] if isinstance(p["compression_options"], dict) else {}
    m = options.get("momentum", 0)
    if p["compression"] == "none" or isinstance(m, bool) or not isinstance(m, (int, float)) or not m:
        return []      # no momentum correction, or a bad value _check_compressor reports
    from mpidist.flat import Layout
    from mpidist.optim import build_optimizer
    opt = build_optimizer(o["name"], Layout([("w", (2, 2)), ("b", (2,))]), lr=o["lr"], **o["hyper"])
    if getattr(opt, "momentum", 0.0) > 0:
        return [f"[parallel] compression_options.momentum = {options['momentum']} (momentum "
                f"correction) replaces the optimizer's momentum: set [optim] hyper.momentum = 0 "
                f"(optimizer {o['name']!r} has momentum {opt.momentum})"]
    return []


def support_errors(parallel: dict) -> list[str]:
    """The data-parallel keys (compression, accumulation) set to something the strategy
    cannot honour, as error messages (none when it honours what it is given)."""
    strategy, errors = parallel["strategy"], []
    if parallel["compression"] != "none":
        if strategy in ("ps", "admm"):
            errors.append(f"[parallel] compression = {parallel['compression']!r}: strategy = "
                          f"{strategy!r} exchanges no gradients by allreduce; remove it "
                          f"(compression works with dp, zero and pipeline)")
        elif strategy == "zero" and parallel["stage"] != 1 and not _decodes_alone(parallel["compression"]):
            errors.append(f"[parallel] compression = {parallel['compression']!r} works with zero "
                          f"stage = 1 only (stages 2 and 3 reduce-scatter gradient buckets, and "
                          f"its payloads decode only once summed over all ranks); use stage = 1 "
                          f"or another compressor")
    if parallel["accumulation"] != 1 and strategy in ("pipeline", "ps", "admm"):
        hint = ("; the pipeline's micro-batches already split each step: raise microbatches"
                if strategy == "pipeline" else "; remove it")
        errors.append(f"[parallel] accumulation = {parallel['accumulation']} is not supported "
                      f"with strategy = {strategy!r}{hint}")
    return errors


def _fault_tolerance_errors(cfg: dict, given: set) -> list[str]:
    """[job] fault_tolerance = "shrink" with what it cannot recover, as error messages."""
    p, ft = cfg["parallel"], cfg["job"]["fault_tolerance"]
    if ft == "off":
        return ["[job] shard_restore needs fault_tolerance = 'shrink'"] if "shard_restore" in given else []
    errors = []
    if p["strategy"] not in ("dp", "zero") or (p["strategy"] == "zero" and p["stage"] not in (1, 2)):
        errors.append("[job] fault_tolerance = 'shrink' works with strategy = 'dp' and 'zero' stage 1 or 2")
    if p["compression"] != "none":
        errors.append("[job] fault_tolerance = 'shrink' does not restore compression residuals; "
                      "set [parallel] compression = 'none'")
    if p["algorithm"] == "shm":
        errors.append("[parallel] algorithm = 'shm' uses a shared-memory window, which MPI's fault "
                      "tolerance does not cover; use 'auto' or 'ring'")
    if "shard_restore" in given and p["strategy"] != "zero":
        errors.append("[job] shard_restore applies to strategy = 'zero' (dp restores from the survivors' replicas)")
    if p["strategy"] == "zero" and cfg["job"]["shard_restore"] == "checkpoint" and cfg["checkpoint"]["interval"] == 0:
        errors.append("[job] shard_restore = 'checkpoint' needs [checkpoint] interval > 0")
    return errors


def _decodes_alone(compression: str) -> bool:
    """Whether each rank's payload decompresses by itself (the compressed reduce-scatter of
    ZeRO stages 2 and 3 needs it); an unknown name is reported elsewhere."""
    from mpidist.compress import COMPRESSORS
    return getattr(COMPRESSORS.get(compression), "decodes_alone", True)


def check_support(config: dict) -> None:
    """ConfigError when the strategy cannot honour [parallel] compression or accumulation
    (for strategies built from a config that skipped validate)."""
    errors = support_errors(config["parallel"])
    if errors:
        raise ConfigError("\n".join(errors))


def _check_optimizer(o: dict) -> list[str]:
    """Build the optimizer on a two-tensor layout: its registry and constructor check the names."""
    from mpidist.flat import Layout
    try:
        from mpidist.optim import build_optimizer
    except ImportError as exc:
        return [f"[optim] mpidist.optim is not available: {exc}"]
    if not isinstance(o["hyper"], dict):
        return []
    for reserved in ("lr", "offset", "count"):
        if reserved in o["hyper"]:
            return [f"[optim] hyper.{reserved}: set it as [optim] {reserved} (or not at all)"]
    try:
        build_optimizer(o["name"], Layout([("w", (2, 2)), ("b", (2,))]), lr=o["lr"], **o["hyper"])
    except (TypeError, ValueError) as exc:
        return [f"[optim] {exc}"]
    return []


def _check_model(cfg: dict) -> list[str]:
    """Construct the model for a stand-in dataset shape, so bad sizes fail here, not on 4 ranks."""
    from mpidist.nn import build_model, data_kwargs
    meta = {"in_shape": (1, 8, 8), "classes": 10, "vocab": 256, "block": cfg["data"]["block"]}
    kw = {k: cfg["model"][k] for k in MODEL_KEYS[cfg["model"]["name"]]}
    try:
        build_model(cfg["model"]["name"], **kw, **data_kwargs(cfg["model"]["name"], meta))
    except (TypeError, ValueError) as exc:
        return [f"[model] {exc}"]
    return []


def load_toml(path: str) -> dict:
    """Parse a TOML file; ConfigError with the parser's line/column on a syntax error."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: TOML syntax error: {exc}") from None


def load_config(path: str, comm, overrides: dict | None = None) -> dict:
    """Collective: rank 0 reads and validates; every rank gets the config or the same ConfigError."""
    result = None
    if comm.rank == 0:
        try:
            raw = load_toml(path)
            for dotted, value in (overrides or {}).items():
                sec, key = dotted.split(".", 1)
                raw.setdefault(sec, {})[key] = value
            stem = os.path.splitext(os.path.basename(path))[0]
            result = ("ok", validate(raw, name=stem, world_size=comm.size))
        except ConfigError as exc:
            result = ("error", str(exc))
        except Exception as exc:  # a bug in validation must not leave the other ranks waiting
            result = ("error", f"config validation failed: {type(exc).__name__}: {exc}")
    status, payload = comm.comm.bcast(result, root=0)
    if status == "error":
        raise ConfigError(payload)
    return payload


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
