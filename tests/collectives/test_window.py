"""SharedBuffer: ranges of a window-resident buffer summed in place, same bits everywhere."""
import numpy as np
import pytest

from mpidist.collectives.window import SharedBuffer


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


def test_reductions_are_on_the_flight_record(comm):
    """The watchdog sees a SharedBuffer reduction that never completes: each is recorded."""
    from mpidist.collectives import flight
    if not SharedBuffer.usable(comm, np.float32):
        pytest.skip("needs several ranks on one node")
    buf = SharedBuffer(64, np.float32, comm)
    buf.allreduce_async(0, 64).wait()
    buf.fence()
    rec = flight.records(comm)[-2:]
    assert [r["call"] for r in rec] == ["shared_allreduce(lo=0, hi=64)", "shared_fence()"], rec
    assert all(r["end"] is not None for r in rec), rec
    buf.free()
