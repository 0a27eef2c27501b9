"""What the CuPy and numba.cuda optimizer kernels share: chunk tables and rounded coefficients.

Segmented sums run one GPU block per chunk (a piece of the optimizer's range cut into at most
GPU_CHUNK elements); coefficients are rounded once from the float64 hyperparameters to
float32, as the CPU kernels round them, so all backends compute the same bits.
See docs/ARCHITECTURE.md (kernels).
"""
from __future__ import annotations

import numpy as np

__all__ = ["GPU_CHUNK", "THREADS", "gpu_chunks", "adam_consts", "onebit_lamb_consts"]

GPU_CHUNK = 8192      # elements per block of a segmented sum
THREADS = 256         # threads per block (a power of two: the shared-memory tree needs it)


def gpu_chunks(plan, chunk: int = GPU_CHUNK):
    """(lo, hi, seg) int64: the plan's pieces cut into chunks of at most `chunk` elements."""
    lo, hi, seg = [], [], []
    for k, s in enumerate(plan.pseg):
        a, b = int(plan.pbounds[k]), int(plan.pbounds[k + 1])
        starts = np.arange(a, b, chunk, dtype=np.int64)
        lo.append(starts)
        hi.append(np.minimum(starts + chunk, b))
        seg.append(np.full(starts.shape, s, np.int64))
    cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))
    return cat(lo), cat(hi), cat(seg)


def adam_consts(gscale, b1, b2, eps, bc1, bc2):
    """The float32 coefficients (gs, B1, C1, B2, C2, D1, D2, E) of the Adam direction,
    rounded once from the float64 hyperparameters (as optim_cpu._adam_consts)."""
    f = np.float32
    return (f(gscale), f(b1), f(1.0 - b1), f(b2), f(1.0 - b2), f(bc1), f(bc2), f(eps))


def onebit_lamb_consts(b1, b2, eps, bc1, bc2, bc2f):
    """The float32 coefficients (B1, C1, B2, C2, D1, D2, D2F, E) of 1-bit LAMB's compression
    stage, rounded once (as optim_cpu._onebit_lamb_consts)."""
    f = np.float32
    return (f(b1), f(1.0 - b1), f(b2), f(1.0 - b2), f(bc1), f(bc2), f(bc2f), f(eps))
