"""The backend group's worker: its waits nap while backward may still run, and (where each
rank has a core of its own) stop napping from the end of the backward that queued
collectives until its queue is empty (DDP then waits for its buckets, and nothing on the
rank computes)."""
import threading

import pytest

torch = pytest.importorskip("torch", reason="needs torch (scripts/setup_env.sh installs it)")

from mpi4py import MPI  # noqa: E402

from mpidist import threads  # noqa: E402
from mpidist.collectives import waits  # noqa: E402
from mpidist.comm import Communicator  # noqa: E402
from mpidist.torch.backend import Group  # noqa: E402


def test_the_worker_hurries_from_the_end_of_backward_until_its_queue_is_empty(monkeypatch):
    monkeypatch.setattr(threads, "core_per_rank", lambda: True)
    g = Group(Communicator(MPI.COMM_SELF))
    if g._pool is None:
        g.shutdown()
        pytest.skip("without MPI_THREAD_MULTIPLE the group has no worker")
    seen, release, started = {}, threading.Event(), threading.Event()
    finished = []

    def during():                   # runs on the worker while backward still runs
        seen["during"] = waits._pause().hurry()
        started.set()
        release.wait(10)
        seen["after"] = waits._pause().hurry()   # backward over, this job still queued

    def hook(grad):
        g._submit(finished.append, during)
        started.wait(10)            # the worker looked before backward ends
        return grad

    x = torch.ones(3, requires_grad=True)
    x.register_hook(hook)
    try:
        (x * 2).sum().backward()
        release.set()
        while not finished:
            threading.Event().wait(1e-3)
        g._submit(finished.append, lambda: seen.setdefault("later", waits._pause().hurry()))
        while len(finished) < 2:
            threading.Event().wait(1e-3)
    finally:
        release.set()
        g.shutdown()
    assert finished == [None, None]
    assert seen == {"during": False, "after": True, "later": False}
