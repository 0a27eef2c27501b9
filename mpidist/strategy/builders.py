"""What a job config builds: the model, the optimizer and its learning rate, and the
gradient compression, the same way for every strategy (dp, zero, pipeline, ps, admm).

The config is the validated nested dict of engine.config; the loop adds
config["job"]["total_steps"] before it builds the strategy.
"""
from __future__ import annotations

from mpidist.compress import CompressedAllreduce, make_compressor
from mpidist.nn import build_model, data_kwargs
from mpidist.optim import build_optimizer
from mpidist.optim.lr_schedules import build_lr_schedule

__all__ = ["MODEL_KEYS", "build_model_from_config", "lr_schedule", "build_optimizer_from_config",
           "build_compression"]

# the [model] keys each model takes (the others are an error in engine.config)
MODEL_KEYS = {"mlp": ("hidden", "activation", "dropout"), "cnn": ("channels",),
              "gpt": ("dim", "heads", "layers", "dropout")}


def build_model_from_config(config: dict, meta: dict):
    """The [model] section plus the sizes the dataset dictates (meta) -> an mpidist.nn model."""
    name = config["model"]["name"]
    kw = {k: config["model"][k] for k in MODEL_KEYS[name]}
    if "dropout" in kw:
        kw["seed"] = config["job"]["seed"]
    return build_model(name, **kw, **data_kwargs(name, meta))


def lr_schedule(config: dict):
    """The [optim] learning rate: a number, or a schedule callable(step) over job.total_steps."""
    o = config["optim"]
    if o["schedule"] == "constant" and o["warmup_steps"] == 0:
        return o["lr"]
    total = max(config["job"]["total_steps"], o["warmup_steps"])
    return build_lr_schedule(o["schedule"], o["lr"], total, warmup_steps=o["warmup_steps"],
                             end_lr=o["end_lr"])


def build_optimizer_from_config(config: dict, layout, offset: int = 0, count: int | None = None):
    """The [optim] section -> mpidist.optim optimizer over global elements [offset, offset+count)."""
    o = config["optim"]
    return build_optimizer(o["name"], layout, lr=lr_schedule(config), **o["hyper"], offset=offset,
                           count=count)


def build_compression(config: dict, comm) -> CompressedAllreduce | None:
    """[parallel] compression, compression_options, compression_warmup, compression_allreduce
    -> the CompressedAllreduce summing gradients over comm (collective use), or None when
    compression = "none". nonfinite="skip": an inf/NaN gradient comes back NaN on every rank
    (residuals untouched), so the optimizer step that follows skips everywhere."""
    p = config["parallel"]
    if p["compression"] == "none":
        return None
    compressor = make_compressor(p["compression"], **p.get("compression_options", {}))
    return CompressedAllreduce(compressor, comm, algorithm=p.get("compression_allreduce", "auto"),
                               warmup_steps=p.get("compression_warmup", 0), nonfinite="skip")
