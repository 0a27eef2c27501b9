"""Half-precision casting: fp16 with a power-of-two scale, and bf16.

fp16 has 5 exponent bits: gradients above 65504 overflow and below 2**-24 vanish. The
compressor multiplies by 2**k, chosen from max|x| so that max|x| * 2**k lies in
[2**14, 2**15): no overflow even when a few ranks' values are summed, and small entries
keep the most precision. A power of two scales exactly; k travels with the payload.

Error bounds (round to nearest even):
  fp16: |x - C(x)| <= 2**-11 |x| + 2**-39 max|x|     (the second term: fp16 subnormals)
  bf16: |x - C(x)| <= 2**-8 |x| + 2**-134             (fp32's exponent range: no scaling;
                                                       the second term: subnormals)

Both re-quantize cleanly, so the compressed allreduce runs a ring on encoded chunks.
"""
from __future__ import annotations

import numpy as np

from mpidist.compress.base import Compressor, kernels_for
from mpidist.kernels.backend import get_array_module

__all__ = ["FP16", "BF16"]


def _scale_exponent(amax_bits: int) -> int:
    """k with max|x| * 2**k in [2**14, 2**15); 0 for an all-zero (or fp32-subnormal) x."""
    e = (int(amax_bits) >> 23) & 0xFF
    return 0 if e == 0 else 14 - (e - 127)


class FP16(Compressor):
    """float16 casting with a power-of-two scale: payload (float16 bits, [k])."""
    name = "fp16"
    aggregation = "ring"

    def __init__(self, *, scaling: bool = True, error_feedback: bool = False, seed: int = 0):
        super().__init__(error_feedback=error_feedback, seed=seed)
        if not isinstance(scaling, (bool, np.bool_)):
            raise TypeError(f"scaling must be a bool, got {type(scaling).__name__}")
        self.scaling = bool(scaling)

    def config(self) -> dict:
        return {**super().config(), "scaling": self.scaling}

    def encode(self, x, layout):
        xp = get_array_module(x)
        K = kernels_for(x)
        bits = x.view(np.uint32)
        k = _scale_exponent(K.absmax_bits(bits)) if self.scaling else 0
        half = xp.empty(x.shape[0], dtype=np.uint16)
        K.fp16_encode(bits, k, half)
        return (half, xp.asarray(np.array([k], dtype=np.int32))), {"n": x.shape[0]}

    def decode_add(self, payload, ctx, out) -> None:
        half, k = payload
        k = int(k[0])
        xp = get_array_module(half)
        # x = float16(x * 2**k) * 2**-k
        if xp is np:
            pow2 = np.ldexp(1.0, np.arange(32) - 25 - k)
            pow2[0] = pow2[1]                  # subnormals: m * 2**(-24 - k)
            kernels_for(out).fp16_decode_add(half, pow2, out)
        else:
            out += xp.ldexp(half.view(np.float16).astype(np.float32), -k)


class BF16(Compressor):
    """bfloat16 casting (fp32's exponent range, 8 significant bits): payload (bf16 bits,)."""
    name = "bf16"
    aggregation = "ring"

    def __init__(self, *, error_feedback: bool = False, seed: int = 0):
        super().__init__(error_feedback=error_feedback, seed=seed)

    def encode(self, x, layout):
        xp = get_array_module(x)
        half = xp.empty(x.shape[0], dtype=np.uint16)
        kernels_for(x).bf16_encode(x.view(np.uint32), half)
        return (half,), {"n": x.shape[0]}

    def decode_add(self, payload, ctx, out) -> None:
        (half,) = payload
        # x = bits << 16 reinterpreted as float32
        out += (half.astype(np.uint32) << np.uint32(16)).view(np.float32)
