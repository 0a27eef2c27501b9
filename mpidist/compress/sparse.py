"""What the sparsifiers (top-k, random-k) share: a kept ratio, and Deep Gradient
Compression's techniques for training at 1% density in short runs (Lin et al., "Deep
Gradient Compression", ICLR 2018).

Per call, on each rank, for the one buffer this compressor serves:
  1. local gradient clipping:  g <- g * min(1, clip_norm / ||g||)
  2. momentum correction:      u <- m u + g;  v <- v + u    (without momentum: v <- v + g)
     the residual v accumulates the velocity, not the raw gradient, so what is sent adds
     up to what momentum SGD would have applied
  3. sparsify v at this call's ratio: the warm-up's stages, then `ratio`
  4. v <- v - C(v); momentum factor masking: u <- 0 where C(v) sent, so a sent
     coordinate's stale velocity does not keep pushing it after its update
Invariant: sum of what was sent + v = sum of the u (or g) accumulated. Momentum correction
is meant for momentum SGD (set the optimizer's own momentum to 0). warmup: stages
[[ratio, calls], ...] run before `ratio`, e.g. DGC's exponential ramp.
"""
from __future__ import annotations

import math

import numpy as np

from mpidist.compress.base import Compressor, check_ratio, kept_count
from mpidist.kernels.backend import to_numpy

__all__ = ["Sparsifier", "check_warmup", "exponential_warmup"]


def _is_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating))


def check_warmup(warmup, ratio: float) -> tuple[tuple[float, int], ...]:
    """Warm-up stages as ((ratio, calls), ...), each ratio in [ratio, 1], calls >= 1."""
    if isinstance(warmup, (str, bytes)) or not hasattr(warmup, "__iter__"):
        raise TypeError(f"warmup must be a list of [ratio, steps] stages, got "
                        f"{type(warmup).__name__}")
    stages = []
    for i, stage in enumerate(warmup):
        if isinstance(stage, (str, bytes)) or not hasattr(stage, "__len__") or len(stage) != 2:
            raise ValueError(f"warmup stage {i} must be a [ratio, steps] pair, got {stage!r}")
        r, n = stage
        if not _is_number(r) or not ratio <= float(r) <= 1.0:
            raise ValueError(f"warmup stage {i}: ratio must be in [{ratio}, 1] (at least the "
                             f"final ratio; stages are [ratio, steps] pairs), got {r!r}")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"warmup stage {i}: steps must be an int >= 1, got {n!r}")
        stages.append((float(r), int(n)))
    return tuple(stages)


def exponential_warmup(start: float, ratio: float, stage_steps: int, factor: float = 4.0):
    """DGC's ramp as stages: start, start/factor, ... while above ratio, stage_steps each.
    exponential_warmup(0.25, 0.01, 11) -> [[0.25, 11], [0.0625, 11], [0.015625, 11]]."""
    stages, r = [], float(start)
    while r > ratio:
        stages.append([r, int(stage_steps)])
        r /= factor
    return stages


class Sparsifier(Compressor):
    """Base of top-k and random-k: ratio, warm-up, momentum correction, clipping.

    ratio: the kept fraction after warm-up, in (0, 1].
    warmup: [[ratio, steps], ...] stages before it (see the module docstring).
    momentum: DGC momentum correction's m in [0, 1) (0: off); needs error feedback.
    momentum_masking: zero the velocity where a value was sent (with momentum > 0).
    clip_norm: clip this rank's gradient (of this buffer) to this L2 norm, or None.
    Subclasses say which positions a payload sent (`sent_indices`).
    """
    aggregation = "gather"

    def __init__(self, ratio: float = 0.01, *, warmup=(), momentum: float = 0.0,
                 momentum_masking: bool = True, clip_norm: float | None = None,
                 error_feedback: bool = True, seed: int = 0):
        super().__init__(error_feedback=error_feedback, seed=seed)
        self.ratio = check_ratio(ratio)
        self.warmup = check_warmup(warmup, self.ratio)
        if not _is_number(momentum) or not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1) (0: no momentum "
                             f"correction), got {momentum!r}")
        self.momentum = float(momentum)
        if self.momentum and not self.error_feedback:
            raise ValueError("momentum correction accumulates the velocity into the "
                             "error-feedback residual: it needs error_feedback=True")
        if not isinstance(momentum_masking, (bool, np.bool_)):
            raise TypeError(f"momentum_masking must be a bool, got "
                            f"{type(momentum_masking).__name__}")
        self.momentum_masking = bool(momentum_masking)
        if clip_norm is not None and (not _is_number(clip_norm) or not float(clip_norm) > 0
                                      or not math.isfinite(float(clip_norm))):
            raise ValueError(f"clip_norm must be a finite number > 0 (or left out: no "
                             f"clipping), got {clip_norm!r}")
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.velocity = None

    def config(self) -> dict:
        return {**super().config(), "ratio": self.ratio,
                "warmup": [list(s) for s in self.warmup], "momentum": self.momentum,
                "momentum_masking": self.momentum_masking, "clip_norm": self.clip_norm}

    # ---------------------------------------------------------------- the ratio
    def ratio_at(self, step: int) -> float:
        """The kept ratio of call `step` (0-based): the warm-up stage's, then `ratio`."""
        for r, calls in self.warmup:
            if step < calls:
                return r
            step -= calls
        return self.ratio

    def k_of(self, n: int) -> int:
        """How many of n elements this call keeps."""
        return kept_count(self.ratio_at(self.step), n)

    @property
    def masks_velocity(self) -> bool:
        return self.momentum > 0 and self.momentum_masking

    def check_algorithm(self, algorithm: str) -> None:
        super().check_algorithm(algorithm)
        if algorithm == "ring" and self.masks_velocity:
            raise ValueError(f"{self.name} with momentum masking needs the gather algorithm: "
                             f"on the ring a rank re-encodes partial sums, so which of its own "
                             f"velocity entries went out is not defined (set "
                             f"momentum_masking=False, or use 'auto')")

    # ---------------------------------------------------------------- the feedback
    def sent_indices(self, payload, ctx):
        """The positions a payload carries values for."""
        raise NotImplementedError

    def _accumulate(self, g):
        # 1. local gradient clipping
        if self.clip_norm is not None:
            norm = float(math.sqrt(float((g.astype(np.float64) ** 2).sum())))
            if norm > self.clip_norm:
                g = g * np.float32(self.clip_norm / norm)
        # 2. momentum correction: the residual accumulates the velocity
        if self.momentum:
            self.velocity = self._state_like(self.velocity, g)
            self.velocity *= np.float32(self.momentum)
            self.velocity += g
            g = self.velocity
        return super()._accumulate(g)

    def residual_of(self, x, payload, ctx):
        """x with the sent entries zeroed (exactly x - decompress(payload))."""
        r = x.copy()
        r[self.sent_indices(payload, ctx)] = 0
        return r

    def _end_pieces(self, x, parts) -> None:
        # 4. momentum factor masking (the residual update is the base class's)
        if self.masks_velocity:
            for start, payload, ctx in parts:
                self.velocity[start + self.sent_indices(payload, ctx).astype(np.int64)] = 0
        super()._end_pieces(x, parts)

    # ---------------------------------------------------------------- checkpointing
    def _extra_state(self) -> dict:
        return {"velocity": None if self.velocity is None else to_numpy(self.velocity).copy()}

    def _load_extra_state(self, sd: dict) -> None:
        v = sd.get("velocity")
        self.velocity = None if v is None else np.array(v, dtype=np.float32)
