"""The cost model's formulas and fits, pure: no MPI, no timing.

`coefficients(algorithm, p)` gives (a, b, g) of T = a alpha + b n beta + g n gamma: message
steps, bytes moved and bytes reduced per byte of input, per rank. The fits turn timed
(bytes, seconds) points into (alpha, beta): one least-squares line over all sizes (for
display) and one line per range between neighbouring probe sizes (what predictions use).
See docs/ARCHITECTURE.md (tuning).
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["coefficients", "fit_least_squares", "line_through", "fit_pieces"]


def _log2(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


def coefficients(algorithm: str, p: int) -> tuple[float, float, float]:
    """(a, b, g): message steps, bytes moved per byte of input, bytes reduced per byte."""
    if p == 1:
        return 0.0, 0.0, 0.0
    lg = _log2(p)
    p2 = 1 << (p.bit_length() - 1)
    lg2, fold = p2.bit_length() - 1, float(p != p2)
    if algorithm in ("ring", "hierarchical"):
        return 2 * (p - 1), 2 * (p - 1) / p, (p - 1) / p
    if algorithm == "tree":
        return 2 * lg - 1, 2 * lg, lg
    if algorithm == "dbtree":
        return 2 * lg, 2.0, 1.0
    if algorithm == "recursive_doubling":
        return lg2 + 2 * fold, lg2 + 2 * fold, lg2 + fold
    if algorithm == "rabenseifner":
        return 2 * lg2 + 2 * fold, 2 * (p2 - 1) / p2 + 2 * fold, (p2 - 1) / p2 + fold
    if algorithm == "shm":
        return 3.0, 2.0, 1.0
    if algorithm == "native":
        return 1.0, 1.0, 0.0
    raise ValueError(f"no cost formula for algorithm {algorithm!r}")


def fit_least_squares(algorithm: str, p: int, gamma: float, sizes, times) -> tuple[float, float]:
    """Least-squares (alpha, beta) >= 0 minimising the relative error of the model."""
    a, b, g = coefficients(algorithm, p)
    t = np.asarray(times, float)
    n = np.asarray(sizes, float)
    rhs = (t - g * n * gamma) / t
    cols = np.stack([np.full_like(n, a) / t, b * n / t], axis=1)
    sol = np.linalg.lstsq(cols, rhs, rcond=None)[0]
    if sol.min() < 0:           # drop the negative term and refit the other alone
        keep = int(np.argmax(sol))
        col = cols[:, keep]
        sol = np.zeros(2)
        sol[keep] = max(0.0, float(col @ rhs / (col @ col)))
    return float(sol[0]), float(sol[1])


def line_through(algorithm: str, p: int, gamma: float, sizes, times) -> tuple[float, float]:
    """(alpha, beta) of the model line through two (bytes, seconds) points, of any sign."""
    a, b, g = coefficients(algorithm, p)
    (n0, n1), (t0, t1) = sizes, times
    r0, r1 = t0 - g * n0 * gamma, t1 - g * n1 * gamma
    beta = (r1 - r0) / (b * (n1 - n0))
    return (r0 - b * n0 * beta) / a, beta


def fit_pieces(algorithm: str, p: int, gamma: float, sizes, times) -> list[list[float]]:
    """[[upto, alpha, beta], ...]: per range between neighbouring probe sizes, the line
    through its two end points; upto is the range's upper end.

    Inside a range the line is exact at both ends and positive between them, whatever the
    signs of alpha and beta: a time that grows faster than the bytes (an MPI library that
    faults in a fresh buffer per call at large sizes) needs a negative alpha. The first and last lines also extend past the probe
    sizes; where the first would fall below zero for fewer bytes, a piece holding the
    first point's time goes before it, and where the last falls with more bytes, a piece
    proportional to the bytes through the last point goes after it."""
    a, b, g = coefficients(algorithm, p)
    pieces = [[sizes[i], *line_through(algorithm, p, gamma, sizes[i - 1:i + 1], times[i - 1:i + 1])]
              for i in range(1, len(sizes))]
    if pieces and pieces[0][1] < 0:
        pieces.insert(0, [sizes[0], max(0.0, times[0] - g * sizes[0] * gamma) / a, 0.0])
    if pieces and pieces[-1][2] < 0:
        per_byte = max(0.0, times[-1] - g * sizes[-1] * gamma) / (b * sizes[-1])
        pieces.append([sizes[-1], 0.0, per_byte])
    return pieces
