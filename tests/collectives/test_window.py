"""SharedBuffer: ranges of a window-resident buffer summed in place, same bits everywhere,
checked like every collective."""
import numpy as np
import pytest

from mpidist.collectives import allreduce
from mpidist.collectives.node import SharedBuffer
from mpidist.errors import MismatchError, RemoteError


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ranges_sum_in_place_with_the_same_bits(comm, dtype):
    if not SharedBuffer.usable(comm, dtype):
        with pytest.raises(ValueError, match="SharedBuffer.usable"):
            SharedBuffer(10, dtype, comm)
        return
    n = 100_003
    buf = SharedBuffer(n, dtype, comm)
    rng = np.random.default_rng(comm.rank)
    for _ in range(2):                       # twice: the buffer is reused after a fence
        mine = rng.standard_normal(n).astype(dtype)
        buf.data[...] = mine
        total = np.sum(comm.comm.allgather(mine), axis=0, dtype=np.float64)
        ranges = [(n - 7, n), (5000, n - 7), (0, 5000), (0, 0)]
        handles = [buf.allreduce_async(lo, hi) for lo, hi in ranges]
        for (lo, hi), h in zip(ranges, handles):
            assert h.wait().shape == (hi - lo,)
        buf.fence()
        np.testing.assert_allclose(buf.data, total, rtol=1e-5, atol=1e-5)
        every = comm.comm.allgather(buf.data.tobytes())
        assert all(b == every[0] for b in every)
    with pytest.raises(ValueError, match="outside"):
        buf.allreduce_async(0, n + 1)
    buf.free()


@pytest.mark.mpi(min_size=2)
def test_reductions_are_on_the_flight_record(comm):
    """The watchdog sees a SharedBuffer reduction that never completes: each is recorded."""
    from mpidist.collectives import flight
    if not SharedBuffer.usable(comm, np.float32):
        pytest.skip("its ranks are on several nodes (the window is one node's)")
    buf = SharedBuffer(64, np.float32, comm)
    buf.allreduce_async(0, 64).wait()
    buf.fence()
    rec = flight.records(comm)[-2:]
    assert [r["call"] for r in rec] == ["shared_allreduce(lo=0, hi=64)", "shared_fence()"], rec
    assert all(r["end"] is not None for r in rec), rec
    buf.free()


@pytest.mark.mpi(min_size=2)
def test_own_values_replace_my_chunk_and_nonfinite_sums_are_counted(comm):
    """Values passed as `own` stand for this rank's chunk (the slice there is not read); an
    Inf or NaN anywhere, on any rank, is counted once per chunk, alike on every rank."""
    if not SharedBuffer.usable(comm, np.float32):
        pytest.skip("its ranks are on several nodes (the window is one node's)")
    n = 10_007
    buf = SharedBuffer(n, np.float32, comm)
    rng = np.random.default_rng(comm.rank)
    mine = rng.standard_normal(n).astype(np.float32)
    total = np.sum(comm.comm.allgather(mine), axis=0, dtype=np.float64)
    lo, hi = 3, n - 5
    a, b = buf.chunk_of(lo, hi)
    buf.data[...] = mine
    buf.data[a:b] = np.nan                       # not read: own covers it, in two pieces
    m = (a + b) // 2
    own = [(m, mine[m:b].copy()), (a, mine[a:m].copy())]
    buf.allreduce_async(lo, hi, own).wait()
    buf.fence()
    assert buf.nonfinite == 0
    np.testing.assert_allclose(buf.data[lo:hi], total[lo:hi], rtol=1e-5, atol=1e-5)
    assert np.array_equal(buf.data[:lo], mine[:lo])
    every = comm.comm.allgather(buf.data[lo:hi].tobytes())
    assert all(x == every[0] for x in every)
    for k, bad in enumerate((np.inf, np.nan)):   # one element on the last rank
        buf.data[...] = mine
        if comm.rank == comm.size - 1:
            buf.data[(lo + 7 * k) % n] = bad
        buf.allreduce_async(lo, hi).wait()
        buf.fence()
        assert buf.nonfinite == k + 1
    with pytest.raises(ValueError, match="inside this rank's chunk"):
        buf.allreduce_async(lo, hi, [(b, mine[:1])])
    buf.free()


@pytest.mark.mpi(min_size=2)
def test_a_call_that_differs_raises_on_every_rank(comm):
    """The guard of every collective: a rank that reduces another range, or passes a range
    outside the buffer, makes every rank raise instead of hanging; the buffer still works."""
    if not SharedBuffer.usable(comm, np.float32):
        pytest.skip("its ranks are on several nodes (the window is one node's)")
    last = comm.rank == comm.size - 1
    buf = SharedBuffer(64, np.float32, comm)
    with pytest.raises(MismatchError, match=r"shared_allreduce\(lo=0, hi=32\)"):
        buf.allreduce_async(0, 32 if last else 64).wait()
    if last:
        with pytest.raises(ValueError, match="outside"):
            buf.allreduce_async(0, 65)
    else:
        with pytest.raises(RemoteError, match="outside"):
            buf.allreduce_async(0, 64).wait()
    buf.data[...] = 1
    buf.allreduce_async(0, 64).wait()
    buf.fence()
    assert np.all(buf.data == comm.size)
    buf.free()


@pytest.mark.mpi(min_size=2)
def test_sums_have_the_bits_of_the_shm_allreduce(comm):
    """One reduction for the node window: the ranks' values added in rank order."""
    if not SharedBuffer.usable(comm, np.float32):
        pytest.skip("its ranks are on several nodes (the window is one node's)")
    n = 70_001
    mine = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    buf = SharedBuffer(n, np.float32, comm)
    buf.data[...] = mine
    a, b = buf.chunk_of(0, n)
    buf.allreduce_async(0, n, [(a, mine[a:b].copy())]).wait()
    buf.fence()
    assert buf.data.tobytes() == allreduce(mine, algorithm="shm", comm=comm).tobytes()
    buf.free()
