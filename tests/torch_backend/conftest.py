"""The "mpidist" torch.distributed backend under test, beside a gloo group over the same
ranks whose results are the reference. Each test module skips without torch."""
from datetime import timedelta

import pytest
from mpi4py import MPI

GLOO_TIMEOUT = timedelta(seconds=20)      # one try at the gloo group's connections
GLOO_TRIES = 3


def gloo_group(dist):
    """A gloo group of every rank, through the default group's store.

    On a loaded machine gloo's connection set-up now and then never finishes on one rank
    while the others return with their group. Each try is bounded by GLOO_TIMEOUT, the
    ranks agree over MPI whether every one of them has its group, and otherwise all drop it
    and try again, so the harness sees a group or an error on every rank, not a hang."""
    error = None
    for _ in range(GLOO_TRIES):
        group, error = None, None
        try:
            group = dist.new_group(backend="gloo", timeout=GLOO_TIMEOUT)
        except RuntimeError as exc:           # torch's DistBackendError is one
            error = exc
        if MPI.COMM_WORLD.allreduce(error is None, op=MPI.LAND):
            return group
        if group is not None:
            dist.destroy_process_group(group)
    raise RuntimeError(f"no gloo group on every rank after {GLOO_TRIES} tries; here: {error}")


@pytest.fixture(scope="module")
def groups():
    """(the default "mpidist" group, a gloo group of the same ranks); torch.distributed is
    initialised for the module's tests and torn down after them."""
    # torch is optional: the test modules skip without it, so it is imported only here
    import torch.distributed as dist

    from mpidist.torch.backend import init_process_group
    init_process_group()
    try:
        yield dist.group.WORLD, gloo_group(dist)
    finally:
        dist.destroy_process_group()
