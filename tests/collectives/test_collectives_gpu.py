"""CuPy buffers: reduced on the device with a CUDA-aware MPI, else staged through the host."""
import numpy as np
import pytest

from mpidist.collectives import allgather, allreduce, reduce_scatter
from mpidist.partition import chunk


@pytest.mark.gpu
@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "recursive_doubling", "native"])
def test_cupy_allreduce(comm, algorithm, staged, monkeypatch):
    """staged: forced through host memory; else as the MPI library says (device pointers
    when it is CUDA-aware)."""
    import cupy as cp
    if staged:
        monkeypatch.setenv("MPIDIST_CUDA_AWARE", "0")
    else:
        monkeypatch.delenv("MPIDIST_CUDA_AWARE", raising=False)
    n = 1000 + comm.size
    for dt in (cp.float32, cp.float16):
        x = cp.arange(n, dtype=dt) + comm.rank
        expect = np.arange(n) * comm.size + sum(range(comm.size))
        y = allreduce(x.copy(), algorithm=algorithm, comm=comm)
        assert isinstance(y, cp.ndarray) and np.allclose(cp.asnumpy(y), expect, rtol=1e-3)
    off, cnt = chunk(n, comm.rank, comm.size)
    shard = reduce_scatter(cp.ones(n, cp.float32), comm=comm)
    assert isinstance(shard, cp.ndarray) and bool((shard == comm.size).all()) and shard.size == cnt
    full = allgather(shard, comm=comm)
    assert isinstance(full, cp.ndarray) and full.size == n and bool((full == comm.size).all())
