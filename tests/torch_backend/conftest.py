"""The "mpidist" torch.distributed backend under test, beside a gloo group over the same
ranks whose results are the reference. Each test module skips without torch."""
import pytest

from tests import gloo


@pytest.fixture(scope="module")
def groups():
    """(the default "mpidist" group, a gloo group of the same ranks); torch.distributed is
    initialised for the module's tests and torn down after them."""
    # torch is optional: the test modules skip without it, so it is imported only here
    import torch.distributed as dist

    from mpidist.torch.backend import init_process_group
    init_process_group()
    try:
        # rendezvous through the default group's store
        yield dist.group.WORLD, gloo.agreed(
            lambda: dist.new_group(backend="gloo", timeout=gloo.TIMEOUT), dist.destroy_process_group)
    finally:
        dist.destroy_process_group()
