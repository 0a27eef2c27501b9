"""CPU tensors seen as 1-D NumPy arrays (zero-copy), as the backend's collectives take them."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

__all__ = ["numpy_view", "bytes_view"]


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """The 1-D NumPy view of a contiguous CPU tensor (no copy; bfloat16 as ml_dtypes')."""
    if t.device.type != "cpu":
        raise TypeError(f"the mpidist backend takes CPU tensors here, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("the mpidist backend takes contiguous tensors; pass t.contiguous() "
                         "(and copy the result back)")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).reshape(-1)
    return t.numpy().reshape(-1)


def bytes_view(t: torch.Tensor) -> np.ndarray:
    """numpy_view(t) as raw bytes."""
    return numpy_view(t).view(np.uint8)
