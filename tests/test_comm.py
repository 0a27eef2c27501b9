"""Communicator: private duplicate, topology (real and simulated), grids, agreement."""
import numpy as np
import pytest
from mpi4py import MPI

from mpidist.comm import Communicator, as_communicator, cuda_aware_mpi
from mpidist.errors import MismatchError, RemoteError


def members(c, parent):
    """Ranks in `parent` of a Communicator's members, in its rank order."""
    return c.comm.allgather(parent.rank)


@pytest.mark.world("compares the default Communicator with COMM_WORLD")
def test_default_is_a_private_duplicate_of_the_world(comm):
    assert comm.comm != MPI.COMM_WORLD
    assert MPI.Comm.Compare(comm.comm, MPI.COMM_WORLD) == MPI.CONGRUENT
    assert (comm.rank, comm.size) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())


def test_detected_topology(comm):
    # one machine: one detected node holding every rank
    assert comm.num_nodes == 1 and comm.node == 0
    assert (comm.local_rank, comm.local_size) == (comm.rank, comm.size)
    assert comm.inter_comm.size == 1 and comm.node_comm.size == comm.size


@pytest.mark.parametrize("rpn", [1, 2, 3, 4])
def test_simulated_nodes(comm, rpn):
    c = Communicator(comm.comm, ranks_per_node=rpn)
    size = comm.size
    nodes = -(-size // rpn)
    assert c.simulated_nodes and c.num_nodes == nodes
    assert c.node == comm.rank // rpn and c.local_rank == comm.rank % rpn
    assert c.node_sizes == [min(rpn, size - k * rpn) for k in range(nodes)]
    assert c.uniform_nodes == (size % rpn == 0 or nodes == 1)
    assert members(c.node_comm, comm) == [r for r in range(size) if r // rpn == c.node]
    assert members(c.inter_comm, comm) == [r for r in range(size) if r % rpn == c.local_rank]
    # the leaves know their own topology
    assert c.node_comm.num_nodes == 1 and c.node_comm.node_comm is c.node_comm
    assert c.inter_comm.num_nodes == c.inter_comm.size
    c.free()


@pytest.mark.mpi(min_size=3)
def test_named_shapes(comm):
    """4 ranks as 2x2 and 4x1; 3 ranks as 3x1 and 1x3 (nodes x ranks per node)."""
    shapes = {4: [(2, 2), (4, 1), (1, 4)], 3: [(3, 1), (1, 3)]}.get(comm.size, [(comm.size, 1)])
    for nodes, per in shapes:
        c = Communicator(comm.comm, ranks_per_node=per)
        assert (c.num_nodes, c.local_size) == (nodes, per)
        c.free()


def test_env_override_and_bad_value(comm, monkeypatch):
    monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", "1")
    c = Communicator(comm.comm)
    assert c.num_nodes == comm.size and c.local_size == 1
    c.free()
    monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", "two")
    with pytest.raises(ValueError, match="positive integer"):
        Communicator(comm.comm)


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_grid(comm, pp):
    size = comm.size
    if size % pp:
        with pytest.raises(ValueError, match="do not divide"):
            comm.grid(pp)
        return
    g = comm.grid(pp)
    assert g is comm.grid(pp)                   # built once
    dp = size // pp
    assert (g.pp, g.dp) == (pp, dp)
    assert g.rank_of(g.stage, g.replica) == comm.rank
    assert members(g.dp_comm, comm) == [g.stage * dp + r for r in range(dp)]
    assert members(g.pp_comm, comm) == [s * dp + g.replica for s in range(pp)]
    assert g.pp_comm.rank == g.stage and g.dp_comm.rank == g.replica


def test_users_own_communicator_is_duplicated_not_used():
    """An existing code passes its own communicator (here: world split in halves)."""
    world = MPI.COMM_WORLD
    user = world.Split(color=world.Get_rank() % 2, key=world.Get_rank())
    c = Communicator(user)
    assert c.size == user.Get_size() and MPI.Comm.Compare(c.comm, user) == MPI.CONGRUENT
    assert as_communicator(c) is c
    assert c.comm.allreduce(1) == user.Get_size()
    c.free()
    user.Free()
    with pytest.raises(TypeError, match="mpi4py"):
        Communicator("world")


def test_split_keeps_nodes(comm):
    c = Communicator(comm.comm, ranks_per_node=2)
    sub = c.split(color=c.rank % 2)
    assert sub is c.split(color=c.rank % 2)
    assert sub.num_nodes == len({r // 2 for r in range(c.size) if r % 2 == c.rank % 2})
    c.free()


def test_check_same_raises_on_every_rank(comm):
    comm.check_same((10, "float32"), "buffer")
    value = (11 if comm.rank == comm.size - 1 else 10, "float32")
    if comm.size == 1:
        comm.check_same(value, "buffer")
        return
    with pytest.raises(MismatchError, match=f"buffer differs across ranks.*ranks {comm.size - 1}"):
        comm.check_same(value, "buffer")


def test_raise_if_any_names_the_failing_rank(comm):
    comm.raise_if_any(None)
    err = ValueError("bad shard") if comm.rank == 0 else None
    expected = ValueError if comm.rank == 0 else RemoteError
    with pytest.raises(expected, match="bad shard"):
        comm.raise_if_any(err)
    assert comm.any(comm.rank == 0) and not comm.all(comm.rank == 0) or comm.size == 1


def test_device_staging_is_identity_for_numpy(comm, monkeypatch):
    x = np.arange(4.0)
    assert comm.to_mpi(x) is x
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "1")
    assert cuda_aware_mpi()
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "maybe")
    with pytest.raises(ValueError, match="0 or 1"):
        cuda_aware_mpi()


def test_split_with_a_new_grouping_never_reuses_another_grouping(comm):
    """Rank 0 keeps colour 0 in both splits while the grouping changes: no stale cache hit."""
    first = comm.split(color=0 if comm.rank == 0 else 1)
    second = comm.split(color=0 if comm.rank < 2 else 1)
    assert first.size == (1 if comm.rank == 0 else comm.size - 1)
    assert second.size == (min(2, comm.size) if comm.rank < 2 else comm.size - 2)


@pytest.mark.gpu
def test_use_gpu_pins_the_node_gpus_round_robin_by_local_rank(comm):
    import cupy as cp
    device = comm.use_gpu()
    assert device == comm.local_rank % cp.cuda.runtime.getDeviceCount()
    assert cp.cuda.Device().id == device
