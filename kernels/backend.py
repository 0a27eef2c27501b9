"""The array module of the data (NumPy or CuPy), found without importing CuPy needlessly.

Importing this module works on a machine with neither CuPy nor a GPU.
See docs/ARCHITECTURE.md (foundation).
"""
import functools
import sys

import numpy as np

__all__ = ["get_array_module", "is_cupy", "byte_view", "cupy_available", "gpu_available",
           "to_numpy", "synchronize", "cupy", "handoff", "take_over"]


def is_cupy(x) -> bool:
    """True for a CuPy array (checked by type name, so CuPy is never imported for it)."""
    return type(x).__module__.split(".")[0] == "cupy"


def get_array_module(*arrays):
    """numpy, or cupy when any argument is a CuPy array."""
    for x in arrays:
        if is_cupy(x):
            return sys.modules["cupy"]
    return np


def byte_view(a):
    """A flat uint8 view of a contiguous NumPy or CuPy array, so MPI moves any dtype
    (bfloat16 too) as MPI.BYTE."""
    return a.reshape(-1).view(np.uint8) if a.size else get_array_module(a).empty(0, np.uint8)


@functools.lru_cache(maxsize=None)
def cupy_available() -> bool:
    """CuPy imports (it may still find no device: see gpu_available)."""
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """CuPy imports and sees at least one CUDA device."""
    if not cupy_available():
        return False
    import cupy                     # optional: checked above
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def cupy():
    """The cupy module; a clear error where it is missing."""
    if not cupy_available():
        raise RuntimeError("this needs CuPy and a CUDA GPU: pip install 'mpidist[gpu]'")
    import cupy as cp               # optional: checked above
    return cp


def to_numpy(x) -> np.ndarray:
    """A host NumPy array with the data of x (no copy for NumPy input)."""
    return x.get() if is_cupy(x) else np.asarray(x)


def synchronize(x=None) -> None:
    """Wait for the current CUDA stream, so MPI reads finished device data."""
    if x is None or is_cupy(x):
        if "cupy" in sys.modules:
            sys.modules["cupy"].cuda.get_current_stream().synchronize()


def handoff(arrays):
    """What another thread needs to work on these arrays, made by this one: (the CuPy
    arrays' device, an event recorded on this thread's current stream after the work that
    produced them); None for host data. CUDA's current device and stream are per thread."""
    for a in arrays:
        if is_cupy(a):
            with a.device:
                return a.device.id, sys.modules["cupy"].cuda.get_current_stream().record()
    return None


def take_over(ready) -> None:
    """In the receiving thread: make handoff()'s device current and order this thread's
    stream after its event (no host wait)."""
    if ready is not None:
        cp = sys.modules["cupy"]
        device, event = ready
        cp.cuda.Device(device).use()
        cp.cuda.get_current_stream().wait_event(event)
