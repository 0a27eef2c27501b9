"""torch tensors <-> NumPy arrays without copies, and the flat buffers that hold a module's
parameters and gradients.

torch.from_numpy and Tensor.numpy share memory, but neither knows bfloat16: those go
through 16-bit integer views of the same bytes (ml_dtypes.bfloat16 on the NumPy side).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

__all__ = ["numpy_dtype", "to_numpy", "from_numpy", "DTYPES"]

DTYPES = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
          torch.bfloat16: np.dtype(ml_dtypes.bfloat16), torch.float64: np.dtype(np.float64)}
_INT = {2: (torch.int16, np.int16), 4: (torch.int32, np.int32), 8: (torch.int64, np.int64)}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype of a floating torch dtype; TypeError for others."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise TypeError(f"torch dtype {dtype} has no NumPy twin here; use one of "
                        f"{', '.join(str(d) for d in DTYPES)}") from None


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing t's memory (t on the CPU; any dtype, bfloat16 included)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing a's memory (bfloat16 included)."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
