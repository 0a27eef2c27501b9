"""How the pipeline executor's transfers make progress: pooled receive buffers, a helper
thread that enters MPI while the rank computes, and the test for when it is not needed.

See docs/ARCHITECTURE.md (pipeline).
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
from mpi4py import MPI

from mpidist import mpilib
from mpidist.comm import Communicator

__all__ = ["BufferPool", "ProgressThread", "single_copy"]


class BufferPool:
    """Receive buffers by (shape, dtype), reused across micro-batches and steps. Keys hold
    dtype objects, not their names: str(dtype) runs NumPy Python code, which right after a
    large matmul (cold caches) sits on the critical path between computes."""

    def __init__(self):
        self._free: dict[tuple, list] = {}
        self.owned: set[int] = set()

    def take(self, xp, shape, dtype):
        free = self._free.get((tuple(shape), np.dtype(dtype)))
        if free:
            return free.pop()
        buf = xp.empty(shape, dtype=dtype)
        self.owned.add(id(buf))
        return buf

    def give(self, buf) -> None:
        self._free.setdefault((buf.shape, buf.dtype), []).append(buf)


class ProgressThread:
    """Enters MPI every `interval` seconds while this rank computes with transfers pending.

    MPI moves a message larger than its eager limit only inside MPI calls of both ends, so
    an Isend followed by a long compute reaches its waiting receiver only after that
    compute (docs/PERFORMANCE.md). An Iprobe for a tag nobody sends drives that progress without
    touching the executor's requests. Between computes the thread sleeps, so it costs
    nothing while the rank itself waits in MPI. Needs MPI_THREAD_MULTIPLE.
    """

    def __init__(self, comm: MPI.Comm, tag: int, interval: float = 1e-4):
        self._comm, self._tag, self._interval = comm, tag, interval
        self._stop = threading.Event()
        self.computing = threading.Event()      # set by the executor around a compute
        self._thread: threading.Thread | None = None

    def __enter__(self):
        self._stop.clear()
        self.computing.clear()
        self._thread = threading.Thread(target=self._loop, name="mpidist-pipeline-progress",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.computing.set()                    # wake the loop so it sees the stop
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.computing.wait()
            if self._stop.is_set():
                return
            self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=self._tag)
            time.sleep(self._interval)


def single_copy(comm: Communicator) -> bool:
    """Whether large messages between the ranks of comm move by single copy: Open MPI's
    shared-memory transport reading the sender's buffer (CMA, XPMEM) on one node, which
    the receiver completes without the sender entering MPI, so no helper thread is needed.
    mpidist's launcher sets the mechanism to "none" where the machine forbids it. With a
    transport that copies through fragments, or across nodes, the sender must progress.
    Where single copy works the helper's wake-ups only slow the computes (docs/PERFORMANCE.md)."""
    if comm.num_nodes != 1 or mpilib.family() != "openmpi":
        return False
    return all(os.environ.get(f"OMPI_MCA_btl_{btl}_single_copy_mechanism", "").lower() != "none"
               for btl in ("vader", "sm"))
