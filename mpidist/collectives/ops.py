"""Reduction operators and the dtypes they run on.

An `Op` pairs a NumPy ufunc (used by mpidist's own algorithms, in place with out=) with the
MPI.Op of the same meaning (used by the native algorithm). "avg" reduces with + and divides
once, on the single reduced copy, so every rank still ends with the same bits.

Half precision (float16, ml_dtypes.bfloat16) is reduced in float32 accumulators: the
public layer widens the buffer once, runs the algorithm in float32 and rounds once at the
end, so a long reduction does not lose bits at every hop.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from mpi4py import MPI

from mpidist.kernels.dispatch import kernels_for

__all__ = ["Op", "OPS", "get_op", "SUPPORTED_DTYPES", "check_dtype", "accumulator_dtype",
           "dtype_name", "reduce_into", "widen", "narrow"]


@dataclass(frozen=True)
class Op:
    """A reduction: `ufunc(a, b, out=)` combines, `finalize(x, n)` post-processes once."""
    name: str
    ufunc: np.ufunc
    mpi_op: MPI.Op
    average: bool = False

    def finalize(self, x, n: int) -> None:
        """Divide the reduced sum by the number of contributors n (only for "avg")."""
        if not self.average or n == 1 or x.size == 0:
            return
        if x.dtype.kind in "iu":
            np.floor_divide(x, n, out=x)       # integer average rounds toward -inf
        else:
            np.divide(x, x.dtype.type(n), out=x)

    @property
    def base(self) -> "Op":
        """The op without its finalize step (avg -> sum), for reductions nested in a larger one."""
        return OPS["sum"] if self.average else self


OPS: dict[str, Op] = {
    "sum": Op("sum", np.add, MPI.SUM),
    "avg": Op("avg", np.add, MPI.SUM, average=True),
    "min": Op("min", np.minimum, MPI.MIN),
    "max": Op("max", np.maximum, MPI.MAX),
    "prod": Op("prod", np.multiply, MPI.PROD),
}


def get_op(op) -> Op:
    """The Op for a name (or an Op itself); ValueError listing the valid names otherwise."""
    if isinstance(op, Op):
        return op
    found = OPS.get(op) if isinstance(op, str) else None
    if found is not None:
        return found
    if isinstance(op, str) and op.lower() in OPS:
        return OPS[op.lower()]
    raise ValueError(f"unknown reduction op {op!r}; valid ops: {', '.join(OPS)}")


SUPPORTED_DTYPES = tuple(np.dtype(t) for t in (
    np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int32, np.int64))
_HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


_ACC = {dt: np.dtype(np.float32) if dt in _HALF else dt for dt in SUPPORTED_DTYPES}
_NAMES = {dt: str(dt) for dt in SUPPORTED_DTYPES}


def dtype_name(dtype) -> str:
    """'float32', 'bfloat16', ... (cached for the supported dtypes)."""
    return _NAMES.get(dtype) or str(dtype)


def check_dtype(dtype) -> np.dtype:
    """The dtype if mpidist reduces it; TypeError naming the supported ones otherwise."""
    dt = dtype if dtype in _ACC else np.dtype(dtype)
    if dt not in _ACC:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"dtype {dt} is not supported by mpidist collectives; use one of {names}")
    return dt


def accumulator_dtype(dtype) -> np.dtype:
    """float32 for float16/bfloat16, the dtype itself otherwise."""
    acc = _ACC.get(dtype)
    return acc if acc is not None else _ACC[check_dtype(dtype)]


def widen(half, out) -> None:
    """out (float32, same device and length) = half (float16 or bfloat16), exactly, with
    the bit-level cast kernels (NumPy's float16 cast is a scalar loop, 4x slower)."""
    kernels = kernels_for(half)
    decode = kernels.fp16_decode if half.dtype == np.float16 else kernels.bf16_decode
    decode(half.view(np.uint16), out.view(np.uint32))


def narrow(wide, out) -> None:
    """out (float16 or bfloat16) = wide (float32) rounded to nearest even, as NumPy's cast
    rounds (NaN stays NaN, inf stays inf)."""
    kernels = kernels_for(out)
    if out.dtype == np.float16:
        kernels.fp16_encode(wide.view(np.uint32), 0, out.view(np.uint16))
    else:
        kernels.bf16_encode(wide.view(np.uint32), out.view(np.uint16))


def reduce_into(op: Op, a, b, out) -> None:
    """out = a (op) b, elementwise, without temporaries; device work finished before return
    so MPI may send `out` right away."""
    op.ufunc(a, b, out=out)
    if type(out) is not np.ndarray and type(out).__module__.split(".")[0] == "cupy":
        import cupy                   # optional: out is a CuPy array
        cupy.cuda.get_current_stream().synchronize()
