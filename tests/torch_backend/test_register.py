"""After register(), torch's own init_process_group("mpidist") works under mpiexec with no
MASTER_ADDR/PORT, RANK or WORLD_SIZE set: they come from MPI."""
import os

import pytest

torch = pytest.importorskip("torch", reason="needs torch (scripts/setup_env.sh installs it)")
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpidist.torch.backend import build, register  # noqa: E402

KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env():
    saved = {k: os.environ.pop(k) for k in KEYS if k in os.environ}
    yield
    for k in KEYS:
        os.environ.pop(k, None)
    os.environ.update(saved)


def test_torch_init_process_group_after_register(clean_env):
    why = build.unavailable()
    if why:
        pytest.skip(f"the backend's C++ extension can not be built here: {why}")
    register()
    assert os.environ["RANK"] == str(MPI.COMM_WORLD.Get_rank())
    dist.init_process_group("mpidist")
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (MPI.COMM_WORLD.Get_rank(),
                                                            MPI.COMM_WORLD.Get_size())
        t = torch.ones(10)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((10,), float(dist.get_world_size())))
    finally:
        dist.destroy_process_group()


def test_mpidist_torch_exports_init_process_group_lazily():
    import mpidist.torch as mt
    from mpidist.torch import backend
    assert mt.init_process_group is backend.init_process_group


def test_init_on_a_host_communicator():
    """init_process_group(comm): torch's ranks are comm's (here COMM_WORLD's reversed), and
    the host's communicator stays its own."""
    from mpidist.torch.backend import init_process_group
    if build.unavailable():
        pytest.skip(f"the backend's C++ extension can not be built here: {build.unavailable()}")
    world = MPI.COMM_WORLD
    host = world.Split(0, world.Get_size() - 1 - world.Get_rank())
    init_process_group(host)
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (host.Get_rank(), host.Get_size())
        t = torch.tensor([float(world.Get_rank())])
        dist.broadcast(t, 0)                     # torch's rank 0 is the world's last rank
        assert t.item() == world.Get_size() - 1
        assert host.allreduce(1) == host.Get_size()
    finally:
        dist.destroy_process_group()
        host.Free()
