"""reduce_scatter and allgather on their own, with the uneven chunk() shards ZeRO uses."""
import ml_dtypes
import numpy as np
import pytest

from .collectives_data import close, lengths, make, references
from mpidist.collectives import allgather, reduce_scatter
from mpidist.errors import RemoteError
from mpidist.partition import chunk


@pytest.mark.parametrize("algorithm", ["ring", "shm", "native", "auto"])
def test_reduce_scatter_then_allgather(comm, algorithm):
    cases = [(np.dtype(dt), op, n, make(comm.rank, dt, op, n, i))
             for i, (dt, op, n) in enumerate(
                 (dt, op, n) for dt in (np.float32, ml_dtypes.bfloat16, np.int64)
                 for op in ("sum", "avg", "max") for n in lengths(comm.size))]
    refs = references(comm, cases)
    bad = []
    for (dt, op, n, x), ref in zip(cases, refs):
        off, cnt = chunk(n, comm.rank, comm.size)
        shard = reduce_scatter(x, op=op, comm=comm, algorithm=algorithm)
        if shard.shape != (cnt,) or not close(shard, ref[off:off + cnt]):
            bad.append(f"reduce_scatter {dt} {op} n={n}")
        full = allgather(shard, comm=comm, algorithm=algorithm)
        if full.shape != (n,) or not close(full, ref):
            bad.append(f"allgather {dt} {op} n={n}")
        into = np.zeros(n, dt)
        if allgather(shard, comm=comm, out=into, algorithm=algorithm) is not into \
                or not close(into, ref):
            bad.append(f"allgather out= {dt} {op} n={n}")
    assert not bad, bad[:5]


@pytest.mark.parametrize("algorithm", ["ring", "shm", "native", "auto"])
def test_in_place_into_own_chunk(comm, algorithm):
    n = 4 * comm.size + 3
    x = np.arange(n, dtype=np.float64) + comm.rank
    off, cnt = chunk(n, comm.rank, comm.size)
    expect = (np.arange(n, dtype=np.float64) * comm.size + sum(range(comm.size)))[off:off + cnt]
    got = reduce_scatter(x, comm=comm, out=x[off:off + cnt], algorithm=algorithm)
    assert np.array_equal(got, expect) and np.array_equal(x[off:off + cnt], expect)
    full = allgather(x[off:off + cnt], comm=comm, out=x, algorithm=algorithm)  # ZeRO's pattern
    assert full is x and np.array_equal(x, np.arange(n) * comm.size + sum(range(comm.size)))


def test_allgather_rejects_shards_off_the_partition(comm):
    shard = np.ones(int(comm.rank == comm.size - 1), np.float32)   # chunk() puts it on rank 0
    if comm.size > 1:
        with pytest.raises(ValueError, match="chunk"):
            allgather(shard, comm=comm)
    # chunk(3p+1, ., p) gives rank 0 four elements: rank 0 is wrong, the others hear of it
    with pytest.raises(ValueError if comm.rank == 0 else RemoteError, match="chunk"):
        allgather(np.ones(3, np.float32), comm=comm, out=np.zeros(3 * comm.size + 1, np.float32))
