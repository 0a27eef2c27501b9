"""Optimizers over flat buffers (SGD, AdamW, LARS, LAMB, 1-bit Adam and 1-bit LAMB),
learning-rate schedules and loss scaling.

    opt = build_optimizer("lamb", layout, lr=1e-3, weight_decay=0.01, offset=o, count=c)
    info = opt.step(params, grads, reduce_norms=allreduce_sum)

See docs/ARCHITECTURE.md (optimizers).
"""
from mpidist.optim.adamw import AdamW
from mpidist.optim.base import DEFAULT_EXCLUDE, LayerwiseOptimizer, Optimizer, StepInfo
from mpidist.optim.lamb import LAMB
from mpidist.optim.lars import LARS
from mpidist.optim.onebit import OnebitAdam, OnebitLAMB
from mpidist.optim.lr_schedules import LR_SCHEDULES, LRSchedule, build_lr_schedule, scale_lr
from mpidist.optim.scaler import DynamicLossScaler
from mpidist.optim.sgd import SGD

__all__ = ["OPTIMIZERS", "build_optimizer", "Optimizer", "LayerwiseOptimizer", "StepInfo",
           "SGD", "AdamW", "LARS", "LAMB", "OnebitAdam", "OnebitLAMB", "DynamicLossScaler",
           "LRSchedule", "LR_SCHEDULES", "build_lr_schedule", "scale_lr", "DEFAULT_EXCLUDE"]

OPTIMIZERS = {"sgd": SGD, "adamw": AdamW, "lars": LARS, "lamb": LAMB,
              "onebit_adam": OnebitAdam, "onebit_lamb": OnebitLAMB}


def build_optimizer(name: str, layout, **hyper) -> Optimizer:
    """The optimizer registered under `name` (sgd, adamw, lars, lamb, onebit_adam,
    onebit_lamb) built on `layout`."""
    try:
        cls = OPTIMIZERS[name.lower() if isinstance(name, str) else name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown optimizer {name!r}; choose one of "
                         f"{', '.join(OPTIMIZERS)}") from None
    return cls(layout, **hyper)
