"""The "mpidist" torch.distributed backend under test, beside a gloo group over the same
ranks whose results are the reference. Skipped without torch."""
import pytest

torch = pytest.importorskip("torch", reason="needs torch (scripts/setup_env.sh installs "
                                            "torch==2.13.0)")
import torch.distributed as dist  # noqa: E402

from mpidist.torch.backend import build, init_process_group  # noqa: E402


@pytest.fixture(scope="module")
def groups():
    """(the default "mpidist" group, a gloo group of the same ranks); torch.distributed is
    initialised for the module's tests and torn down after them."""
    why = build.unavailable()
    if why:
        pytest.skip(f"the backend's C++ extension can not be built here: {why}")
    init_process_group()
    gloo = dist.new_group(backend="gloo")       # rendezvous through the default group's store
    yield dist.group.WORLD, gloo
    dist.destroy_process_group()
