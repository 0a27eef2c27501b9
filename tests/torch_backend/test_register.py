"""`import mpidist.torch` registers the "mpidist" backend, and under an MPI launcher torch's
own init_process_group("mpidist") then works with no MASTER_ADDR/PORT, RANK or WORLD_SIZE
set. The backend is plain Python: a job with no compiler on PATH runs DDP on it, and nothing
is compiled on import or first use."""
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="needs torch (scripts/setup_env.sh installs it)")
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpidist.torch as mt  # noqa: E402
from mpidist.torch import backend  # noqa: E402

KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TOOLS = ("c++", "g++", "gcc", "cc", "clang", "clang++", "ninja", "nvcc")


def test_import_registers_the_backend():
    assert dist.is_backend_available("mpidist")
    assert mt.init_process_group is backend.init_process_group


@pytest.fixture
def clean_env():
    saved = {k: os.environ.pop(k) for k in KEYS + (backend._MARK,) if k in os.environ}
    yield
    for k in KEYS + (backend._MARK,):
        os.environ.pop(k, None)
    os.environ.update(saved)


def test_torch_init_process_group_after_register(clean_env):
    backend.register()
    assert os.environ["RANK"] == str(MPI.COMM_WORLD.Get_rank())
    dist.init_process_group("mpidist")
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (MPI.COMM_WORLD.Get_rank(),
                                                            MPI.COMM_WORLD.Get_size())
        assert isinstance(dist.group.WORLD, backend.ProcessGroup)
        t = torch.ones(10)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((10,), float(dist.get_world_size())))
    finally:
        dist.destroy_process_group()


def test_variables_a_parent_rank_filled_are_replaced(clean_env):
    """A job started from inside a rank inherits that rank's variables: they are not its
    own, so register() fills them anew."""
    os.environ.update(RANK="7", WORLD_SIZE="9", MASTER_PORT="1")
    os.environ[backend._MARK] = str(os.getppid())       # filled by another process
    backend.register()
    assert os.environ["WORLD_SIZE"] == str(MPI.COMM_WORLD.Get_size())
    assert os.environ["MASTER_PORT"] != "1"
    os.environ["RANK"] = "5"                             # the user's own value is kept
    backend.register()
    assert os.environ["RANK"] == "5"


def test_init_on_a_host_communicator():
    """init_process_group(comm): torch's ranks are comm's (here COMM_WORLD's reversed), and
    the host's communicator stays its own."""
    world = MPI.COMM_WORLD
    host = world.Split(0, world.Get_size() - 1 - world.Get_rank())
    mt.init_process_group(host)
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (host.Get_rank(), host.Get_size())
        t = torch.tensor([float(world.Get_rank())])
        dist.broadcast(t, 0)                     # torch's rank 0 is the world's last rank
        assert t.item() == world.Get_size() - 1
        assert host.allreduce(1) == host.Get_size()
    finally:
        dist.destroy_process_group()
        host.Free()


JOB = """
import os, shutil, sys
os.environ["PATH"] = sys.argv[1]                # (Open MPI puts its own bin first in a rank's)
for key in ("CXX", "CC"):
    os.environ.pop(key, None)
assert not [t for t in {tools!r} if shutil.which(t)], "a compiler is on PATH"
import torch, torch.distributed as dist
import mpidist.torch
dist.init_process_group("mpidist")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
model(torch.randn(3, 4)).sum().backward()
t = torch.ones(5)
dist.all_reduce(t)
assert torch.equal(t, torch.full((5,), float(dist.get_world_size())))
assert "torch.utils.cpp_extension" not in sys.modules, "something loaded the extension builder"
dist.destroy_process_group()
print("OK")
"""


@pytest.mark.launcher
def test_a_job_with_no_compiler_on_path(tmp_path):
    """Two ranks under mpiexec whose PATH holds no program at all: import, torch's
    init_process_group("mpidist") with no rendezvous variables set, DDP and an allreduce
    run, and nothing loads torch's extension builder."""
    from mpidist.launcher import run
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in KEYS + (backend._MARK,)}
    proc = run(2, [sys.executable, "-c", JOB.format(tools=TOOLS), str(empty)], env=env,
               capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("OK") == 2, proc.stdout
