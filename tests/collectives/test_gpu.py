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


@pytest.mark.gpu
def test_cupy_out_of_place_and_fused_buckets(comm):
    """out= on the device (the input left as it was), and a model's gradients as CuPy
    arrays fused into buckets by allreduce_async."""
    import cupy as cp
    from mpidist.collectives import allreduce_async
    n = 1001
    x = cp.arange(n, dtype=cp.float32) + comm.rank
    out = cp.empty_like(x)
    assert allreduce(x, out=out, algorithm="ring", comm=comm) is out
    assert float(x[0]) == comm.rank
    assert np.allclose(cp.asnumpy(out), np.arange(n) * comm.size + sum(range(comm.size)))
    grads = [cp.full(k, comm.rank + 1, cp.float32) for k in (3, 1000, 70_000)]
    done = allreduce_async(grads, algorithm="ring", bucket_bytes=4096, comm=comm).wait()
    total = sum(range(1, comm.size + 1))
    assert all(isinstance(g, cp.ndarray) and bool((g == total).all()) for g in done)


@pytest.mark.gpu
def test_staging_buffers_reused_across_sizes_and_dtypes(comm, monkeypatch):
    """Staged through the host, the pinned buffers are reused from call to call: calls
    that grow, shrink and change dtype each get exactly their own result, in place, out of
    place, and through reduce_scatter and allgather."""
    import cupy as cp
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "0")
    p, r = comm.size, comm.rank
    for n, dt in ((5000, cp.int32), (17, cp.float64), (100_003, cp.int64), (3, cp.int32),
                  (1500, cp.float16)):
        x = cp.arange(n, dtype=dt) + r
        expect = np.arange(n) * p + sum(range(p))
        out = cp.empty_like(x)
        allreduce(x, out=out, algorithm="ring", comm=comm)
        assert np.array_equal(cp.asnumpy(x), np.arange(n) + r)
        assert np.allclose(cp.asnumpy(out), expect, rtol=1e-3)
        assert np.allclose(cp.asnumpy(allreduce(x, algorithm="tree", comm=comm)), expect,
                           rtol=1e-3)
        off, cnt = chunk(n, r, p)
        shard = reduce_scatter(cp.arange(n, dtype=dt) + r, comm=comm)
        assert np.allclose(cp.asnumpy(shard), expect[off:off + cnt], rtol=1e-3)
        assert np.allclose(cp.asnumpy(allgather(shard, comm=comm)), expect, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_async_waits_for_work_queued_on_the_callers_stream(comm):
    """allreduce_async of data still being computed on the caller's own non-blocking
    stream: the worker thread's reduction is ordered after that work (an event), so it
    reduces the finished values, not a copy taken halfway."""
    import cupy as cp
    from mpidist.collectives import allreduce_async
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.zeros(1 << 24, cp.float32)
        for _ in range(100):                 # milliseconds of queued kernels
            x += 1
        handle = allreduce_async(x, algorithm="ring", comm=comm)
    handle.wait()
    stream.synchronize()
    assert bool((x == 100 * comm.size).all())


@pytest.mark.gpu
def test_async_runs_on_the_devices_of_its_arrays(comm):
    """The worker thread works on the GPU of the arrays it is given, not on device 0 (the
    default of a new thread): float16 gradients on the last GPU, fused into one bucket
    (packed, widened, scattered back on the worker) come back reduced on that GPU."""
    import cupy as cp
    from mpidist.collectives import allreduce_async
    last = cp.cuda.runtime.getDeviceCount() - 1
    if last < 1:
        pytest.skip("needs 2 GPUs visible to each rank")
    with cp.cuda.Device(last):
        grads = [cp.full(k, comm.rank + 1, cp.float16) for k in (3, 1000)]
        done = allreduce_async(grads, bucket_bytes=1 << 20, comm=comm).wait()
        total = sum(range(1, comm.size + 1))
        assert all(g.device.id == last and bool((g == total).all()) for g in done)
