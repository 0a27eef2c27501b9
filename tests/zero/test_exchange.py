"""The v-collectives over arbitrary global ranges that ZeRO stages 2 and 3 are built on."""
import ml_dtypes
import numpy as np
import pytest

from mpidist.zero.exchange import ShardMap, allgather_start, reduce_scatter_start

N = 37   # not divisible by 2, 3 or 4: uneven shards


def _ranges(n):
    return [(0, n), (0, 1), (5, 6), (3, 30), (n - 4, n), (10, 10 + n // 3)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16, np.float16])
def test_reduce_scatter_v_sums_pieces_onto_owners(comm, dtype):
    shards = ShardMap(comm, N)
    for lo, hi in _ranges(N):
        mine = [np.arange(lo, hi, dtype=np.float64) * (r + 1) / 8 for r in range(comm.size)]
        buf = mine[comm.rank].astype(dtype)
        got = reduce_scatter_start(comm, shards, buf, lo).wait()
        start, count = shards.mine(lo, hi)
        total = sum(m.astype(dtype).astype(np.float64) for m in mine)
        want = total[start - lo:start - lo + count].astype(dtype)
        assert got.dtype == np.dtype(dtype) and got.shape == (count,)
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


def test_reduce_scatter_v_adds_into_out(comm):
    shards = ShardMap(comm, N)
    out = np.ones(shards.count, np.float32)
    buf = np.full(N, 2.0, np.float32)
    pend = reduce_scatter_start(comm, shards, buf, 0, out=out)
    # in flight: the bucket and the owner's pieces from the other ranks (its own stays put)
    assert pend.nbytes == buf.nbytes + 4 * shards.count * (comm.size - 1)
    assert pend.wait() is out and pend.nbytes == 0
    np.testing.assert_array_equal(out, 1 + 2.0 * comm.size)       # added into out


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_allgather_v_assembles_any_range(comm, dtype):
    shards = ShardMap(comm, N)
    full = (np.arange(N) * 0.5).astype(dtype)
    shard = full[shards.offset:shards.offset + shards.count].copy()
    pend = [allgather_start(comm, shards, shard, lo, hi) for lo, hi in _ranges(N)]
    for (lo, hi), p in zip(_ranges(N), pend):          # several in flight at once
        np.testing.assert_array_equal(p.wait().astype(np.float64), full[lo:hi].astype(np.float64))
