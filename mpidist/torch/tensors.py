"""torch tensors <-> NumPy and CuPy arrays without copies, and torch's CUDA stream as the
one the CuPy side queues on.

torch.from_numpy and Tensor.numpy share memory, but neither knows bfloat16: those go
through 16-bit integer views of the same bytes (ml_dtypes.bfloat16 on the NumPy side).
CUDA tensors are seen as CuPy arrays through DLPack; CuPy work queued inside
`torch_stream(device)` runs on torch's current stream, so it is ordered after the work
that made its input and before the work that reads its output, with no host wait.
"""
from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import torch

from mpidist.kernels.backend import cupy

__all__ = ["numpy_dtype", "to_numpy", "from_numpy", "DTYPES", "flat_buffer", "torch_stream",
           "device_synchronize"]

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


def flat_buffer(n: int, dtype: np.dtype, device) -> tuple:
    """(array, tensor): n zeros of dtype on device, as a NumPy (CPU) or CuPy (CUDA) array
    and a torch tensor over the same memory. torch allocates CUDA memory (its caching
    allocator, its streams); CuPy sees it through DLPack."""
    device = torch.device(device)
    if device.type == "cpu":
        a = np.zeros(n, dtype)
        return a, from_numpy(a)
    tdtype = next(t for t, d in DTYPES.items() if d == dtype)
    t = torch.zeros(n, dtype=tdtype, device=device)
    return cupy().from_dlpack(t), t


@contextlib.contextmanager
def torch_stream(device):
    """CuPy work queued inside runs on torch's current stream of device (CPU: nothing)."""
    device = torch.device(device)
    if device.type != "cuda":
        yield
        return
    cp = cupy()
    s = torch.cuda.current_stream(device)
    external = getattr(cp.cuda.Stream, "from_external", None)  # CuPy 14's protocol form
    if external is not None and hasattr(s, "__cuda_stream__"):
        stream = external(s)
    else:
        stream = cp.cuda.ExternalStream(s.cuda_stream, s.device_index)
    with cp.cuda.Device(s.device_index), stream:
        yield


def device_synchronize(device) -> None:
    """Wait for every stream of a CUDA device (torch's, CuPy's, the collectives' worker
    threads'); nothing for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
