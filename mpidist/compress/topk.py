"""Top-k sparsification with error feedback: send the k = ceil(ratio * n) largest |x|.

Two ways to find them, both one pass over the gradient after a small random sample:
- "exact": from the sample, a threshold a bit below the k-th largest |x|; collect the
  ~1.3k candidates above it; select exactly k among them (falls back to a full
  selection when the sample misjudged). Ties at the k-th |x| go to the lowest indices.
- "sampled": the sample's estimate of the k-th largest |x| is the threshold; whatever lies
  above is sent (about k; at most 2k, else the exact path runs). Cheaper, size varies.

Payload: (values float32, indices uint32 [int64 beyond 2**32 elements]), ascending
indices. Bound: the dropped part equals the residual exactly, and for exact top-k
||x - C(x)||^2 <= (1 - k/n) ||x||^2.
"""
from __future__ import annotations

import math

import numpy as np

from mpidist.compress.base import kernels_for, step_seed
from mpidist.compress.sparse import Sparsifier
from mpidist.kernels.backend import get_array_module

__all__ = ["TopK"]

_METHODS = ("exact", "sampled")
_SAMPLE_PER_KEPT = 1000     # sample size ~ 1000 / ratio: ~3% relative error of the count


def _index_dtype(n: int):
    return np.uint32 if n <= 2**32 else np.int64


def _topk(x, k: int, method: str, seed: int):
    """(indices ascending, values) of k largest |x| (or ~k for method "sampled"); the same
    passes and the same picks on either device (the kernels' sample positions and tie
    rule are shared), so a CuPy gradient sends what its NumPy copy would."""
    K, xp = kernels_for(x), get_array_module(x)
    n = x.shape[0]
    idt = _index_dtype(n)
    S = min(n, max(4096, int(_SAMPLE_PER_KEPT * n / max(k, 1))))
    if 2 * S < n:
        # 1. threshold from a sample: expected q sample points above the k-th largest
        sample = xp.empty(S, dtype=np.float32)
        K.sample_abs(x, seed, sample)
        q = k * S / n
        above = math.ceil(q) if method == "sampled" else math.ceil(1.3 * q + 3 * math.sqrt(q) + 1)
        above = min(S, max(1, above))
        thr = xp.partition(sample, S - above)[S - above]
        # 2. one pass: the candidates above the threshold
        cap = 2 * k if method == "sampled" else 3 * k + 1024
        cand = xp.empty(cap, dtype=idt)
        c = K.collect_above(x, thr, cand)
        if method == "sampled" and 0 < c <= cap:
            idx = cand[:c]
            return idx, x[idx]
        if k <= c <= cap:
            # 3. exactly k among the candidates, kept in index order
            return _select(K, xp, x, cand[:c], k, idt)
    # fallback (small n, or the sample misjudged): a selection among all n
    return _select(K, xp, x, xp.arange(n, dtype=idt), k, idt)


def _select(K, xp, x, cand, k: int, idt):
    """The k largest |x| among the candidates (ascending), ties to the lowest indices."""
    a = xp.abs(x[cand])
    kth = xp.partition(a, a.size - k)[a.size - k]
    idx = xp.empty(k, dtype=idt)
    vals = xp.empty(k, dtype=np.float32)
    K.select_k(x, cand, kth, k, idx, vals)
    return idx, vals


class TopK(Sparsifier):
    """The k largest-magnitude entries, with error feedback (on by default); warm-up,
    momentum correction and clipping as in mpidist.compress.sparse."""
    name = "topk"
    aggregation = "gather"

    def __init__(self, ratio: float = 0.01, *, method: str = "exact", warmup=(),
                 momentum: float = 0.0, momentum_masking: bool = True,
                 clip_norm: float | None = None, error_feedback: bool = True, seed: int = 0):
        super().__init__(ratio, warmup=warmup, momentum=momentum,
                         momentum_masking=momentum_masking, clip_norm=clip_norm,
                         error_feedback=error_feedback, seed=seed)
        if method not in _METHODS:
            raise ValueError(f"top-k method must be one of {', '.join(_METHODS)}, got {method!r}")
        self.method = method

    def config(self) -> dict:
        return {**super().config(), "method": self.method}

    def encode(self, x, layout):
        n = x.shape[0]
        k = self.k_of(n)
        xp = get_array_module(x)
        if k == 0:
            return (xp.empty(0, np.float32), xp.empty(0, _index_dtype(n))), {"n": n}
        seed = step_seed(self.seed, self.stream, self.step)
        idx, vals = _topk(x, k, self.method, seed)
        return (vals, idx), {"n": n}

    def decode_add(self, payload, ctx, out) -> None:
        vals, idx = payload
        if get_array_module(out) is np:
            kernels_for(out).scatter_add(idx, vals, out)
        else:
            out[idx] += vals     # indices within one payload are distinct

    def sent_indices(self, payload, ctx):
        return payload[1]
