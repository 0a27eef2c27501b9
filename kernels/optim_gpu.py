"""GPU kernels of the optimizers: CuPy (optim_cupy) and numba.cuda (optim_numba_cuda).

Same contract as optim_cpu (float32 storage and element arithmetic with float32 coefficients
rounded once, no fused multiply-add, float64 sums of squares, one fused pass per update,
per-chunk sums summed per segment on the host), and the same interface (`CuPyKernels`,
`NumbaCudaKernels`) that mpidist.optim calls. This module gathers both for callers that
want either; mpidist.optim imports the one it needs only when a GPU backend is used.
See docs/ARCHITECTURE.md (kernels).
"""
from mpidist.kernels.optim_cupy import CuPyKernels
from mpidist.kernels.optim_gpu_shared import (GPU_CHUNK, THREADS, adam_consts, gpu_chunks,
                                              onebit_lamb_consts)
from mpidist.kernels.optim_numba_cuda import NumbaCudaKernels

__all__ = ["CuPyKernels", "NumbaCudaKernels", "adam_consts", "onebit_lamb_consts", "gpu_chunks",
           "GPU_CHUNK", "THREADS"]
