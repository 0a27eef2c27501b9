"""Checks of optimizer hyperparameters at the public boundary, with messages that name them.

TypeError for a wrong type, ValueError for a value out of range; shared by every optimizer,
the learning-rate schedules and the loss scaler. See docs/ARCHITECTURE.md (optim).
"""
from __future__ import annotations

import fnmatch
import numbers

import numpy as np

from mpidist.flat import Layout

__all__ = ["check_lr", "check_number", "check_betas", "check_adam_flags", "check_eps",
           "match_names"]


def check_lr(lr):
    """A learning rate: a number >= 0, or a schedule callable(step) -> number."""
    if callable(lr):
        return lr
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real):
        raise TypeError(f"lr must be a number or a callable(step) -> lr, got {type(lr).__name__}")
    if not np.isfinite(lr) or lr < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr}")
    return float(lr)


def check_number(name, value, lo=None, hi=None, lo_open=False, hi_open=False) -> float:
    """A real hyperparameter inside [lo, hi] (or open ends), with a message naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    bad = not np.isfinite(value) and not (hi == np.inf and value == np.inf)
    if lo is not None:
        bad |= value <= lo if lo_open else value < lo
    if hi is not None:
        bad |= value >= hi if hi_open else value > hi
    if bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        raise ValueError(f"{name} must lie in {left}{lo}, {hi}{right}, got {value}")
    return value


def check_betas(betas) -> tuple[float, float]:
    """(beta1, beta2), each in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    return (check_number("beta1", betas[0], 0.0, 1.0, hi_open=True),
            check_number("beta2", betas[1], 0.0, 1.0, hi_open=True))


def check_adam_flags(amsgrad, bias_correction) -> tuple[bool, bool]:
    """The two boolean options the Adam-moment optimizers (AdamW, LAMB) share."""
    for what, flag in (("amsgrad", amsgrad), ("bias_correction", bias_correction)):
        if not isinstance(flag, bool):
            raise TypeError(f"{what} must be a bool, got {type(flag).__name__}")
    return amsgrad, bias_correction


def check_eps(eps) -> float:
    """eps > 0 and a normal float32 (states are fp32: a smaller eps flushes to zero there)."""
    eps = check_number("eps", eps, 0.0, lo_open=True)
    tiny = float(np.finfo(np.float32).tiny)
    if eps < tiny:
        raise ValueError(f"eps={eps} is too small for float32 states (smallest normal "
                         f"{tiny:.3g}); use e.g. 1e-8")
    return eps


def match_names(layout: Layout, patterns) -> np.ndarray:
    """bool per layout segment: its name matches one of the fnmatch patterns."""
    if isinstance(patterns, str) or not isinstance(patterns, (tuple, list)) or \
            not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"exclude must be a tuple or list of name patterns (str), "
                        f"got {patterns!r}")
    return np.array([any(fnmatch.fnmatchcase(n, p) for p in patterns) for n in layout.names],
                    dtype=bool)
