"""The job config: validation against the schema, defaults, and loading on every rank.

`validate(raw)` checks the WHOLE document and returns a plain nested dict with every key of
every section present (defaults filled in), or raises ConfigError listing every problem at
once. `load_config(path, comm)` runs it on rank 0 only and broadcasts the result, so a bad
config gives the same one message on every rank and no rank starts work.

Sections and keys are engine.schema's SCHEMA (`mpidist train --show-schema` prints it); the
strategies (engine.strategies) say which [parallel] keys are theirs and what they cannot
honour; bad compressor, optimizer and model options are found by building them once.
"""
from __future__ import annotations

import difflib
import os
import tomllib

from mpidist.collectives.select import load_table
from mpidist.compress import COMPRESSORS, make_compressor
from mpidist.engine.schema import SCHEMA, format_schema
from mpidist.engine.strategies import STRATEGIES
from mpidist.errors import ConfigError
from mpidist.flat import Layout
from mpidist.kernels.backend import gpu_available
from mpidist.optim import build_optimizer
from mpidist.strategy import onebit
from mpidist.strategy.builders import MODEL_KEYS, build_model_from_config

__all__ = ["validate", "load_config", "load_toml", "format_schema", "SCHEMA"]


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
    owners: dict = {}                   # a key may belong to several strategies
    for strat, cls in STRATEGIES.items():
        for key in cls.keys:
            owners.setdefault(key, []).append(strat)
    for key, strats in owners.items():
        if key in given_keys["parallel"] and strategy not in strats:
            errors.append(f"[parallel] {key} applies to strategy = {' or '.join(map(repr, strats))} "
                          f"only (this job uses {strategy!r})")
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
    if cfg["job"]["device"] == "gpu" and not gpu_available():
        errors.append("[job] device = 'gpu' needs CuPy and a CUDA GPU on this machine")
    if cfg["job"]["epochs"] == 0 and cfg["job"]["steps"] == 0:
        errors.append("[job] set epochs > 0 or steps > 0")
    compression = cfg["parallel"]["compression"]
    if compression != "none":
        errors += ([f"[parallel] compression = {compression!r}: unknown compressor; choose one of "
                    f"{', '.join(sorted(COMPRESSORS))}"] if compression not in COMPRESSORS
                   else _check_compressor(cfg["parallel"]))
    else:
        errors += [f"[parallel] {key} needs compression = '<name>'"
                   for key in ("compression_options", "compression_warmup", "compression_allreduce")
                   if key in given_keys["parallel"]]
    if strategy in STRATEGIES:
        errors += STRATEGIES[strategy].config_errors(cfg["parallel"], world_size)
    errors += _fault_tolerance_errors(cfg, given_keys["job"])
    errors += _check_optimizer(cfg)
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


def _check_compressor(p: dict) -> list[str]:
    """Build the compressor once with its options: a bad option fails here, not mid-run."""
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


def _fault_tolerance_errors(cfg: dict, given: set) -> list[str]:
    """[job] fault_tolerance = "shrink" with what it cannot recover, as error messages."""
    p, ft = cfg["parallel"], cfg["job"]["fault_tolerance"]
    if ft == "off":
        return ["[job] shard_restore needs fault_tolerance = 'shrink'"] if "shard_restore" in given else []
    errors = []
    if p["strategy"] not in ("dp", "zero", "diloco", "local_sgd") or \
            (p["strategy"] == "zero" and p["stage"] not in (1, 2)):
        errors.append("[job] fault_tolerance = 'shrink' works with strategy = 'dp', 'zero' stage 1 or 2, "
                      "'diloco' and 'local_sgd'")
    if p["compression"] != "none":
        errors.append("[job] fault_tolerance = 'shrink' does not restore compression residuals; "
                      "set [parallel] compression = 'none'")
    if p["strategy"] in ("diloco", "local_sgd") and p["outer_compression"] != "none":
        errors.append("[job] fault_tolerance = 'shrink' does not restore the outer exchange's residuals "
                      "(a lost group leader takes its group's with it); set [parallel] outer_compression = 'none'")
    if p["algorithm"] == "shm":
        errors.append("[parallel] algorithm = 'shm' uses a shared-memory window, which MPI's fault "
                      "tolerance does not cover; use 'auto' or 'ring'")
    if "shard_restore" in given and p["strategy"] != "zero":
        errors.append("[job] shard_restore applies to strategy = 'zero' (dp, diloco and local_sgd restore "
                      "from the survivors' replicas)")
    if p["strategy"] == "zero" and cfg["job"]["shard_restore"] == "checkpoint" and cfg["checkpoint"]["interval"] == 0:
        errors.append("[job] shard_restore = 'checkpoint' needs [checkpoint] interval > 0")
    return errors


def _check_optimizer(cfg: dict) -> list[str]:
    """Build the optimizer on a two-tensor layout (its registry and constructor check the
    names), then what it rules out: momentum correction beside its own momentum (SGD, LARS:
    momentum applied twice), and a 1-bit optimizer's own conditions (strategy.onebit)."""
    o, p = cfg["optim"], cfg["parallel"]
    if not isinstance(o["hyper"], dict):
        return []
    for reserved in ("lr", "offset", "count"):
        if reserved in o["hyper"]:
            return [f"[optim] hyper.{reserved}: set it as [optim] {reserved} (or not at all)"]
    try:
        opt = build_optimizer(o["name"], Layout([("w", (2, 2)), ("b", (2,))]), lr=o["lr"], **o["hyper"])
    except (TypeError, ValueError) as exc:
        return [f"[optim] {exc}"]
    options = p["compression_options"] if isinstance(p["compression_options"], dict) else {}
    m = options.get("momentum", 0)      # not a number: _check_compressor reports it
    corrected = p["compression"] != "none" and not isinstance(m, bool) and isinstance(m, (int, float)) and m
    if corrected and getattr(opt, "momentum", 0.0) > 0:
        return [f"[parallel] compression_options.momentum = {m} (momentum correction) replaces "
                f"the optimizer's momentum: set [optim] hyper.momentum = 0 (optimizer "
                f"{o['name']!r} has momentum {opt.momentum})"] + onebit.config_errors(cfg, opt)
    return onebit.config_errors(cfg, opt)


def _check_model(cfg: dict) -> list[str]:
    """Construct the model for a stand-in dataset shape, so bad sizes fail here, not on 4 ranks."""
    meta = {"in_shape": (1, 8, 8), "classes": 10, "vocab": 256, "block": cfg["data"]["block"]}
    try:
        build_model_from_config(cfg, meta)
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
