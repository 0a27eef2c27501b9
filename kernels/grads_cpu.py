"""Numba CPU kernels for gradients arriving from a framework (mpidist.torch).

A gradient handed over by autograd is copied into the flat buffer (scaled, for an average
over the ranks: copy_scaled_finite) and checked for Inf/NaN in the same pass, so neither
the finiteness of a step nor the average costs a pass of its own. copy_finite and
all_finite work on the raw bits (uint32 for float32, uint16 for float16/bfloat16) with the
dtype's exponent mask: an exponent field of all ones is an Inf or a NaN (an integer max
vectorises; a float test in a branch does not); copy_scaled_finite tests v - v, which is 0
for a finite v and NaN otherwise, a test without a branch. See docs/ARCHITECTURE.md
(PyTorch models).
"""
import numpy as np
from numba import njit

__all__ = ["EXPONENT_MASK", "copy_finite", "copy_scaled_finite", "all_finite"]

# exponent bits of each floating dtype, by name (bfloat16 is ml_dtypes')
EXPONENT_MASK = {"float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}
_OPTS = dict(fastmath=False, error_model="numpy", cache=True, nogil=True)


# the running max is written as a select (not max()), which LLVM vectorises
@njit(**_OPTS)
def _copy_max(dst, src, mask):
    e = mask ^ mask
    for i in range(src.shape[0]):
        v = src[i]
        dst[i] = v
        t = v & mask
        e = e if e > t else t
    return e


@njit(**_OPTS)
def _max(src, mask):
    e = mask ^ mask
    for i in range(src.shape[0]):
        t = src[i] & mask
        e = e if e > t else t
    return e


@njit(**_OPTS)
def _copy_scaled_bad(dst, src, s):
    bad = 0
    for i in range(src.shape[0]):
        v = src[i] * s
        dst[i] = v
        bad |= (v - v) != 0
    return bad


def _bits(a):
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def _mask(a):
    return (np.uint32 if a.dtype.itemsize == 4 else np.uint16)(EXPONENT_MASK[a.dtype.name])


def copy_finite(dst: np.ndarray, src: np.ndarray) -> bool:
    """dst[...] = src (1-D, same dtype); returns whether every element is finite."""
    mask = _mask(src)
    return _copy_max(_bits(dst), _bits(src), mask) != mask


def copy_scaled_finite(dst: np.ndarray, src: np.ndarray, scale: float) -> bool:
    """dst[...] = src * scale (1-D, one float32 or float64 dtype; the product rounded once
    in that dtype); returns whether every product is finite."""
    return not _copy_scaled_bad(dst, src, src.dtype.type(scale))


def all_finite(x: np.ndarray) -> bool:
    """Whether every element of the 1-D float array x is finite."""
    mask = _mask(x)
    return _max(_bits(x), mask) != mask
