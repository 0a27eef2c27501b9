"""QSGD-style stochastic quantization to s levels, unbiased, bit-packed (Alistarh et al.).

Per bucket of `bucket` elements, norm = max |x| (the max-norm variant: lower variance
than the 2-norm at few levels); each element becomes sign(x) * norm * l / s with
  l = floor(|x| / norm * s + u),  u ~ U[0, 1)
so E[C(x)] = x, and |x - C(x)| < norm / s element-wise. u comes from a counter-based hash
of (seed, rank, step, index): reproducible, independent across ranks and steps.
Code width: sign + level bits, rounded up to 2, 4 or 8 bits: s = 7 is 4 bits per element.
Payload: (codes uint8[ceil(n * width / 8)], norms float32[ceil(n / bucket)]).
"""
from __future__ import annotations

import numpy as np

from mpidist.compress.base import Compressor, check_multiple_of_8, kernels_for, step_seed
from mpidist.kernels.backend import get_array_module

__all__ = ["QSGD"]


class QSGD(Compressor):
    """Unbiased stochastic quantization to `levels` levels per sign (1..127)."""
    name = "qsgd"
    aggregation = "gather"

    def __init__(self, levels: int = 7, *, bucket: int = 512, error_feedback: bool = False,
                 seed: int = 0):
        super().__init__(error_feedback=error_feedback, seed=seed)
        if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)):
            raise TypeError(f"QSGD levels must be an int, got {type(levels).__name__}")
        if not 1 <= levels <= 127:
            raise ValueError(f"QSGD levels must be in [1, 127] (7 = 4 bits, 127 = 8 bits), "
                             f"got {levels}")
        self.levels = int(levels)
        self.bucket = check_multiple_of_8(bucket, "QSGD bucket")
        from mpidist.kernels.compress_cpu import qsgd_width   # Numba: loaded on first use
        self.width = qsgd_width(self.levels)

    def config(self) -> dict:
        return {**super().config(), "levels": self.levels, "bucket": self.bucket}

    def encode(self, x, layout):
        n = x.shape[0]
        xp = get_array_module(x)
        codes = xp.empty((n * self.width + 7) // 8, dtype=np.uint8)
        norms = xp.empty(-(-n // self.bucket), dtype=np.float32)
        seed = step_seed(self.seed, self.stream, self.step)
        kernels_for(x).qsgd_encode(x, self.levels, self.bucket, self.width, seed, codes, norms)
        return (codes, norms), {"n": n}

    def decode_add(self, payload, ctx, out) -> None:
        codes, norms = payload
        kernels_for(out).qsgd_decode_add(codes, norms, self.levels, self.bucket, self.width,
                                         out)
