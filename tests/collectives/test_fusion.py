"""Tensor fusion buckets and the nonblocking allreduce handle."""
import ml_dtypes
import numpy as np
import pytest

from mpidist.collectives import Handle, allreduce, allreduce_async
from mpidist.collectives.fusion import buckets


def test_buckets_are_greedy_and_split_by_dtype():
    f4, f8 = np.zeros(10, np.float32), np.zeros(10, np.float64)
    arrays = [f4, f4, f4, f8, f8, np.zeros(100, np.float32), f4]
    assert buckets(arrays, 80) == [[0, 1], [2], [3], [4], [5], [6]]
    assert buckets(arrays, 10_000) == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="positive"):
        buckets(arrays, 0)


def test_async_single_array_in_place_and_out(comm):
    x = np.arange(1000, dtype=np.float32) + comm.rank
    expect = np.arange(1000, dtype=np.float32) * comm.size + sum(range(comm.size))
    h = allreduce_async(x, comm=comm, algorithm="ring")
    assert isinstance(h, Handle)
    y = np.empty_like(x)
    h2 = allreduce_async(np.ones(7), op="avg", comm=comm, out=np.empty(7))
    assert h.wait() is x and np.array_equal(x, expect)
    assert np.array_equal(h2.wait(), np.ones(7)) and h2.done and h2.test()
    allreduce_async(x, comm=comm, out=y, algorithm="native").wait()
    assert np.array_equal(y, expect * comm.size)


def test_fused_tensors_equal_one_by_one(comm):
    rng = np.random.default_rng(comm.rank)
    shapes = [(3, 4), (17,), (1,), (5, 5), (300,), (2, 2, 2)]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads.append(rng.standard_normal(9).astype(ml_dtypes.bfloat16))
    ref = [allreduce(g, op="avg", comm=comm, out=np.empty_like(g)) for g in grads]
    h = allreduce_async(grads, op="avg", comm=comm, bucket_bytes=256)
    other = allreduce(np.full(3, comm.rank, np.int64), comm=comm)   # caller keeps working
    got = h.wait()
    assert got is not None and all(a is b for a, b in zip(got, grads))
    assert np.array_equal(other, np.full(3, sum(range(comm.size))))
    # the same reduction, packed differently: equal up to float32 rounding of the sum order
    assert all(g.shape == r.shape and np.allclose(g.astype(np.float64), r.astype(np.float64),
                                                  rtol=1e-2 if g.dtype.itemsize == 2 else 1e-6)
               for g, r in zip(grads, ref))
    outs = [np.empty_like(g) for g in grads]
    got = allreduce_async(grads, comm=comm, out=outs).wait()
    assert all(a is b for a, b in zip(got, outs)) and len(got) == len(outs)


def test_many_handles_complete_in_order(comm):
    xs = [np.full(50 * (i + 1), i + comm.rank, np.float64) for i in range(8)]
    handles = [allreduce_async(x, comm=comm) for x in xs]
    for i, h in enumerate(reversed(handles)):
        h.wait()
    assert all(np.all(x == comm.size * i + sum(range(comm.size))) for i, x in enumerate(xs))
