"""1-bit sign compression with a per-chunk scale (1-bit SGD / EF-signSGD), error feedback.

Each chunk of `chunk` elements sends its signs (1 bit each, packed 8 per byte) and one
float32 scale s = ||x_c||_1 / |c|; it decodes to s * sign(x) (zero counts as +). The
scale minimises the chunk's squared error, which is then exactly
  ||x_c - C(x_c)||^2 = ||x_c||^2 - ||x_c||_1^2 / |c|   (< ||x_c||^2 unless x_c = 0).
Payload: (bits uint8[ceil(n/8)], scales float32[ceil(n/chunk)]): 1/32 + 1/chunk of fp32
(0.035x at the default chunk of 256; on the digits job 256 trained as well as 64 or 128,
and better than 512).
"""
from __future__ import annotations

import numpy as np

from mpidist.compress.base import Compressor, check_multiple_of_8, kernels_for
from mpidist.kernels.backend import get_array_module

__all__ = ["Sign"]


class Sign(Compressor):
    """Signs plus one mean-magnitude scale per chunk, with error feedback (on by default)."""
    name = "sign"
    aggregation = "gather"

    def __init__(self, *, chunk: int = 256, error_feedback: bool = True, seed: int = 0):
        super().__init__(error_feedback=error_feedback, seed=seed)
        self.chunk = check_multiple_of_8(chunk, "sign chunk")

    def config(self) -> dict:
        return {**super().config(), "chunk": self.chunk}

    def encode(self, x, layout):
        n = x.shape[0]
        xp = get_array_module(x)
        packed = xp.empty((n + 7) // 8, dtype=np.uint8)
        scales = xp.empty(-(-n // self.chunk), dtype=np.float32)
        kernels_for(x).sign_encode(x, self.chunk, packed, scales)
        return (packed, scales), {"n": n}

    fuses_feedback = True

    def encode_feedback(self, x, residual, layout):
        n = x.shape[0]
        xp = get_array_module(x)
        packed = xp.empty((n + 7) // 8, dtype=np.uint8)
        scales = xp.empty(-(-n // self.chunk), dtype=np.float32)
        kernels_for(x).sign_encode_feedback(x, residual, self.chunk, packed, scales)
        return (packed, scales), {"n": n}

    def decode_add(self, payload, ctx, out) -> None:
        packed, scales = payload
        kernels_for(out).sign_decode_add(packed, scales, self.chunk, out)
