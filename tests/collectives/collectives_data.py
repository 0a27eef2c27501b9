"""Shared test data for the collectives tests (imported relatively by them): per-rank
inputs that every rank can name by (rank, case), and the reference results from the MPI
library's own MPI_Allreduce."""
import hashlib

import ml_dtypes
import numpy as np
from mpi4py import MPI

DTYPES = [np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
                                np.int32, np.int64)]
MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}


def lengths(size: int) -> list[int]:
    """0, 1, p-1, p+1, primes, a few thousand."""
    return sorted({0, 1, size - 1, size + 1, 13, 2003})


def make(rank: int, dtype, op: str, n: int, case: int) -> np.ndarray:
    """Small integer values, exact in every dtype, so sums/products are exact too."""
    rng = np.random.default_rng([rank, case])
    if op == "prod":
        v = rng.choice(np.array([-1, 1, 1, 1, 2]), n)
    else:
        v = rng.integers(-8, 9, n)
    return v.astype(dtype)


def references(comm, cases) -> list[np.ndarray]:
    """Expected results of cases [(dtype, op, n, data)] from MPI_Allreduce in float64,
    one MPI call per op."""
    out = [None] * len(cases)
    for op, mpi_op in MPI_OPS.items():
        idx = [i for i, (_, o, _, _) in enumerate(cases) if o == op]
        if not idx:
            continue
        flat = np.concatenate([cases[i][3].astype(np.float64) for i in idx] + [np.zeros(0)])
        total = np.empty_like(flat)
        comm.comm.Allreduce(flat, total, mpi_op)
        at = 0
        for i in idx:
            dt, _, n, _ = cases[i]
            ref = total[at:at + n]
            at += n
            if op == "avg":
                ref = np.floor_divide(ref, comm.size) if dt.kind == "i" else ref / comm.size
            out[i] = ref
    return out


def close(got: np.ndarray, ref: np.ndarray) -> bool:
    """Exact for integers; within one rounding of the dtype for floats."""
    if got.shape != ref.shape:
        return False
    g = got.astype(np.float64)
    if got.dtype.kind == "i":
        return bool(np.array_equal(g, ref))
    eps = float(ml_dtypes.finfo(got.dtype).eps)
    return bool(np.allclose(g, ref, rtol=eps, atol=0))


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
    return h.hexdigest()
