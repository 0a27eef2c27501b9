"""The mismatch guard: disagreeing ranks raise a clear error on every rank, never hang."""
import numpy as np
import pytest

from mpidist.collectives import allreduce, guard, reduce_scatter
from mpidist.errors import MismatchError, RemoteError


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what", ["length", "dtype", "op", "call"])
def test_mismatch_raises_on_every_rank(comm, what):
    last = comm.rank == comm.size - 1
    n = 10 + (what == "length" and last)
    dt = np.float64 if what == "dtype" and last else np.float32
    op = "max" if what == "op" and last else "sum"
    x = np.ones(n, dt)
    with pytest.raises(MismatchError) as err:
        if what == "call" and last:
            reduce_scatter(x, op=op, comm=comm)
        else:
            allreduce(x, op=op, comm=comm)
    msg = str(err.value)
    assert f"ranks {comm.size - 1}:" in msg and "ranks 0" in msg, msg
    # the communicator is still usable afterwards
    assert allreduce(np.ones(3), comm=comm)[0] == comm.size


@pytest.mark.mpi(min_size=2)
def test_bad_argument_on_one_rank_raises_everywhere(comm):
    x = np.ones(4, np.complex64 if comm.rank == 0 else np.float32)
    expected = TypeError if comm.rank == 0 else RemoteError
    with pytest.raises(expected, match="not supported" if comm.rank == 0 else "rank"):
        allreduce(x, comm=comm)


def test_first_mode_remembers_each_signature(comm):
    old = guard.get_mode()
    try:
        guard.set_mode("first")
        for _ in range(3):
            allreduce(np.ones(5, np.float32), algorithm="native", comm=comm)
        allreduce(np.ones(6, np.float32), op="max", algorithm="ring", comm=comm)
        seen = guard.checked(comm)
    finally:
        guard.set_mode(old)
    assert len(seen) == 2 and any("n=6" in s and "op=max" in s for s in seen), seen
    with pytest.raises(ValueError, match="first, always, off"):
        guard.set_mode("sometimes")
