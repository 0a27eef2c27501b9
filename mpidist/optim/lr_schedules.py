"""Learning-rate schedules for large-batch training, and the batch-size scaling rules.

A schedule is a callable(step) -> lr (step counts from 0), so an optimizer takes one as `lr`:
    linear warm-up over `warmup_steps` (Goyal et al. 2017), from warmup_start_lr to base_lr,
    then constant, cosine (Loshchilov & Hutter 2017) or polynomial decay (You et al. 2017)
    to end_lr at total_steps.
Scaling rules for a batch grown from base_batch to batch: linear (lr * k, Goyal et al.) and
square root (lr * sqrt(k), Hoffer et al. 2017; the rule LAMB uses).
See docs/ARCHITECTURE.md (optimizers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mpidist.optim.checks import check_number

__all__ = ["LRSchedule", "build_lr_schedule", "LR_SCHEDULES", "scale_lr", "SCALING_RULES"]

LR_SCHEDULES = ("constant", "cosine", "poly")
SCALING_RULES = ("linear", "sqrt")


@dataclass(frozen=True)
class LRSchedule:
    """Warm-up then decay; call it with the step number."""
    kind: str
    base_lr: float
    total_steps: int
    warmup_steps: int = 0
    end_lr: float = 0.0
    power: float = 2.0
    warmup_start_lr: float = 0.0

    def __post_init__(self):
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {self.kind!r}; choose one of "
                             f"{', '.join(LR_SCHEDULES)}")
        check_number("base_lr", self.base_lr, 0.0)
        check_number("end_lr", self.end_lr, 0.0)
        check_number("warmup_start_lr", self.warmup_start_lr, 0.0)
        check_number("power", self.power, 0.0, lo_open=True)
        for what, v in (("total_steps", self.total_steps), ("warmup_steps", self.warmup_steps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{what} must be an integer >= 0, got {v!r}")
        if self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds total_steps "
                             f"({self.total_steps})")

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            # linear warm-up: reaches base_lr at the last warm-up step
            frac = (step + 1) / self.warmup_steps
            return self.warmup_start_lr + (self.base_lr - self.warmup_start_lr) * frac
        if self.kind == "constant":
            return self.base_lr
        span = max(1, self.total_steps - self.warmup_steps)
        p = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * p))
        else:
            shape = (1.0 - p) ** self.power
        return self.end_lr + (self.base_lr - self.end_lr) * shape


def build_lr_schedule(name: str, base_lr: float, total_steps: int, **kw) -> LRSchedule:
    """An LRSchedule by name: 'constant', 'cosine' or 'poly' (ValueError lists them)."""
    return LRSchedule(name, base_lr, total_steps, **kw)


def scale_lr(base_lr: float, base_batch: int, batch: int, rule: str = "linear") -> float:
    """The learning rate for `batch` from one tuned at `base_batch`: linear or sqrt rule."""
    if rule not in SCALING_RULES:
        raise ValueError(f"unknown scaling rule {rule!r}; choose one of {', '.join(SCALING_RULES)}")
    check_number("base_lr", base_lr, 0.0)
    for what, v in (("base_batch", base_batch), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{what} must be an integer > 0, got {v!r}")
    k = batch / base_batch
    return base_lr * (k if rule == "linear" else math.sqrt(k))
