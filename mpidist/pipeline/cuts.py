"""Stage partitioning: cut a list of layers into contiguous pipeline stages.

Three ways, each returning the stage bounds [0, c1, ..., n] (stage k runs layers
bounds[k] to bounds[k+1]):
  - by parameter count (`by_params`): balances the memory of the stages;
  - by measured cost (`by_cost` on `measure_layer_costs`): balances their time;
  - by explicit cut points from the config (`by_cuts`).
The balanced cuts minimise the largest stage: the slowest stage sets the pipeline's pace.
See docs/ARCHITECTURE.md (pipeline).
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from mpidist.kernels.backend import get_array_module

__all__ = ["balanced_bounds", "by_params", "by_cost", "by_cuts", "measure_layer_costs",
           "stage_bounds", "PARTITION_METHODS"]

PARTITION_METHODS = ("params", "cost", "cuts")


def _check_stages(num_layers: int, num_stages: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, (int, np.integer)):
        raise TypeError(f"number of stages must be an int, got {type(num_stages).__name__}")
    if num_stages < 1:
        raise ValueError(f"number of stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} pipeline stages but the model has only {num_layers} "
                         f"layers: use at most {num_layers} stages (pp x virtual)")


def balanced_bounds(weights: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous cuts of `weights` into num_stages non-empty parts whose largest sum is
    as small as possible (exact dynamic programme, O(stages x layers^2)).

    Each layer also weighs a tiny share of the mean, so among equally good cuts the one
    with fewer layers in its largest stage wins (parameter-free layers still spread out).
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or np.any(~np.isfinite(w)) or np.any(w < 0):
        raise ValueError("layer weights must be a 1-D list of finite non-negative numbers")
    n = len(w)
    _check_stages(n, num_stages)
    w = w + 1e-6 * (w.sum() / n if w.sum() > 0 else 1.0)
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    # best[k][i]: smallest largest-part of the first i layers in k parts; cut[k][i]: last cut
    best = np.full((num_stages + 1, n + 1), np.inf)
    cut = np.zeros((num_stages + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(int(cut[k][bounds[-1]]))
    return bounds[::-1]


def by_params(layers: Sequence, num_stages: int) -> list[int]:
    """Balance parameter counts; layers are modules with param_shapes()."""
    counts = [sum(int(np.prod(s)) for _, s in layer.param_shapes()) for layer in layers]
    return balanced_bounds(counts, num_stages)


def by_cost(costs: Sequence[float], num_stages: int) -> list[int]:
    """Balance a measured per-layer cost (seconds per step)."""
    return balanced_bounds(costs, num_stages)


def by_cuts(cuts: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Explicit cut points: layer indices where stages 1, 2, ... start."""
    _check_stages(num_layers, num_stages)
    cuts = [int(c) for c in cuts]
    if len(cuts) != num_stages - 1:
        raise ValueError(f"{num_stages} stages need {num_stages - 1} cut points, got {cuts}")
    bounds = [0, *cuts, num_layers]
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cut points {cuts} must increase strictly inside (0, {num_layers}) "
                         f"so that every stage has a layer")
    return bounds


def measure_layer_costs(layers: Sequence, x, *, steps: int = 3, warmup: int = 1) -> list[float]:
    """Median seconds of forward + backward of each layer over `steps` runs on input x.

    Layers must be bound to parameters; gradients accumulate into their grad views, so
    zero them afterwards. The backward of each layer gets a ones-like output gradient.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    times = np.zeros((steps, len(layers)))
    for run in range(warmup + steps):
        h = x
        for k, layer in enumerate(layers):
            t0 = time.perf_counter()
            y = layer.forward(h, True)
            layer.backward(get_array_module(y).ones_like(y))
            if run >= warmup:
                times[run - warmup, k] = time.perf_counter() - t0
            h = y
    return [float(t) for t in np.median(times, axis=0)]


def stage_bounds(method: str, layers: Sequence, num_stages: int, *, cuts=None,
                 costs=None) -> list[int]:
    """Bounds by `method` ("params", "cost" with measured costs, "cuts" with cut points)."""
    if method == "params":
        return by_params(layers, num_stages)
    if method == "cost":
        if costs is None or len(costs) != len(layers):
            raise ValueError("partition 'cost' needs one measured cost per layer "
                             "(measure_layer_costs)")
        return by_cost(costs, num_stages)
    if method == "cuts":
        if cuts is None:
            raise ValueError("partition 'cuts' needs the cut points (layer indices where "
                             "stages 1, 2, ... start)")
        return by_cuts(cuts, len(layers), num_stages)
    raise ValueError(f"unknown partition method {method!r}; choose one of {list(PARTITION_METHODS)}")
