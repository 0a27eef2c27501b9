"""The hierarchical 2D-ring allreduce on simulated nodes (nodes x ranks per node)."""
import numpy as np
import pytest

from .collectives_data import close, make, references
from mpidist.collectives import allreduce
from mpidist.comm import Communicator

SHAPES = [(2, 2), (2, 3), (3, 1), (1, 4), (2, 1)]


def _sub(comm, nodes, per_node):
    """The first nodes*per_node ranks as simulated nodes (collective over comm)."""
    inside = comm.rank < nodes * per_node
    mpi = comm.comm.Split(0 if inside else 1, comm.rank)
    sub = Communicator(mpi, ranks_per_node=per_node) if inside else None
    mpi.Free()
    return sub


@pytest.mark.parametrize("nodes,per_node", SHAPES)
def test_hierarchical_on_simulated_nodes(comm, nodes, per_node):
    if nodes * per_node > comm.size:
        pytest.skip(f"{nodes}x{per_node} needs {nodes * per_node} ranks, this run has "
                    f"{comm.size} (the suite runs 1-5 ranks; test_collectives_launcher runs 2x3 "
                    f"at 6)")
    sub = _sub(comm, nodes, per_node)
    bad = []
    if sub is not None:
        assert (sub.num_nodes, sub.local_size) == (nodes, per_node)
        cases = [(np.dtype(dt), op, n, make(sub.rank, dt, op, n, i))
                 for i, (dt, op, n) in enumerate((dt, op, n) for dt in (np.float32, np.int32)
                                                 for op in ("sum", "avg", "min")
                                                 for n in (1, 5, 1001))]
        for (dt, op, n, x), ref in zip(cases, references(sub, cases)):
            if not close(allreduce(x, op=op, algorithm="hierarchical", comm=sub,
                                   out=np.empty_like(x)), ref):
                bad.append(f"{dt} {op} n={n}")
        sub.free()
    assert not bad, bad


@pytest.mark.mpi(min_size=2)
def test_shared_memory_falls_back_to_ring_across_nodes(comm):
    sub = Communicator(comm.comm, ranks_per_node=1)     # every rank its own (simulated) node
    x = np.arange(50, dtype=np.int64) + sub.rank
    got = allreduce(x, algorithm="shm", comm=sub, out=np.empty_like(x))
    assert np.array_equal(got, np.arange(50) * sub.size + sum(range(sub.size)))
    sub.free()


@pytest.mark.mpi(min_size=3)
def test_uneven_nodes_fall_back_to_ring(comm):
    sub = Communicator(comm.comm, ranks_per_node=2)     # 3 ranks: nodes of 2 and 1
    if comm.size % 2:
        assert not sub.uniform_nodes
    x = np.arange(100, dtype=np.float64) * (sub.rank + 1)
    got = allreduce(x, algorithm="hierarchical", comm=sub, out=np.empty_like(x))
    assert np.array_equal(got, np.arange(100) * sum(range(1, sub.size + 1)))
    sub.free()
