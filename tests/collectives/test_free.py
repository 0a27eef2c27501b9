"""Communicator.free() lets go of what the collectives hold for that communicator: its
shared-memory window, its async worker thread and its scratch memory, at any rank count."""
import numpy as np
import pytest
from mpi4py import MPI

from mpidist.collectives import allreduce, allreduce_async, fusion, node, workspace
from mpidist.collectives.node import window
from mpidist.comm import Communicator


def test_free_releases_window_worker_and_scratch():
    c = Communicator(MPI.COMM_WORLD)
    x = np.ones(100_000, np.float32)
    allreduce(x, algorithm="shm", comm=c)                  # a window where shm is usable
    allreduce(np.ones(1000, np.float16), comm=c)            # the float32 copy in scratch
    allreduce_async(x, algorithm="ring", comm=c).wait()     # c's worker thread
    worker, held = fusion._workers[c], window._windows.get(c)
    assert c in workspace._buffers and (held is not None) == node.usable(c)
    c.free()
    assert c not in workspace._buffers and c not in window._windows and c not in fusion._workers
    with pytest.raises(RuntimeError):                       # its thread has been shut down
        worker.pool.submit(print)
    assert held is None or held.freed
