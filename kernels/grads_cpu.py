"""Numba CPU kernels for gradients arriving from a framework (mpidist.torch).

A gradient handed over by autograd is copied into the flat buffer (scaled, for an average
over the ranks: copy_scaled_finite) and checked for Inf/NaN in the same pass, so neither
the finiteness of a step nor the average costs a pass of its own. copy_finite and
all_finite work on the raw bits (uint32 for float32, uint16 for float16/bfloat16) with the
dtype's exponent mask: an exponent field of all ones is an Inf or a NaN (an integer max
vectorises; a float test in a branch does not). sum_finite sums and checks in one pass
(float32/float64): v - v is 0 for a finite v and NaN otherwise, a test without a branch;
it runs block by block (the partial sums stay in cache) without the GIL, in one call.
See docs/ARCHITECTURE.md (PyTorch models).
"""
import numpy as np
from numba import njit

__all__ = ["EXPONENT_MASK", "copy_finite", "copy_scaled_finite", "all_finite", "sum_finite"]

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
def _add_bad(dst, a, b):
    bad = 0
    for i in range(dst.shape[0]):
        v = a[i] + b[i]
        dst[i] = v
        bad |= (v - v) != 0
    return bad


@njit(**_OPTS)
def _acc_bad(dst, b):           # in place: dst is not also an argument (that would not vectorise)
    bad = 0
    for i in range(dst.shape[0]):
        v = dst[i] + b[i]
        dst[i] = v
        bad |= (v - v) != 0
    return bad


@njit(**_OPTS)
def _sum_bad(dst, first, others, block, in_place):
    bad = 0
    for x in range(0, dst.shape[0], block):
        y = min(x + block, dst.shape[0])
        if in_place:
            bad |= _acc_bad(dst[x:y], others[0][x:y])
        else:
            bad |= _add_bad(dst[x:y], first[x:y], others[0][x:y])
        for k in range(1, len(others)):
            bad |= _acc_bad(dst[x:y], others[k][x:y])
    return bad


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


def sum_finite(dst: np.ndarray, others: tuple, first: np.ndarray | None = None,
               block: int = 1 << 16) -> bool:
    """dst[...] = first + others[0] + others[1] + ..., added in that order, `block`
    elements at a time (1-D, one float32 or float64 dtype; first=None: dst itself);
    returns whether every sum is finite (an Inf or NaN among the terms gives a
    non-finite sum)."""
    others = tuple(others)
    return not _sum_bad(dst, dst if first is None else first, others, block, first is None)
