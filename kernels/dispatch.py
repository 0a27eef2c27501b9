"""The kernel module for an array: Numba CPU kernels for NumPy, GPU kernels for CuPy.

Both load Numba (and compile on first use), so they are imported only when data first asks
for them. See docs/ARCHITECTURE.md (foundation).
"""
from mpidist.kernels.backend import is_cupy

__all__ = ["kernels_for"]


def kernels_for(x):
    """The kernel module for x (the compressors' encoders and decoders, and the half
    precision casts of the collectives)."""
    if is_cupy(x):
        from mpidist.kernels import compress_gpu     # slow: Numba CUDA, loaded on first use
        return compress_gpu
    from mpidist.kernels import compress_cpu         # slow: Numba, loaded on first use
    return compress_cpu
