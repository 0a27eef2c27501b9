"""How a thread waits for its MPI requests: inside MPI, or polling with naps.

A rank's own thread waits inside MPI (Wait, Sendrecv): with a core to itself, that answers
soonest. A worker thread that reduces gradient buckets while backward runs on the same
cores must not: MPI's blocking waits poll without pause, and each polling worker takes a
core from the compute it is meant to overlap (across nodes, where a bucket's transfer
takes milliseconds, it would take it for all of them). Threads that run beside compute
call mark_patient() once; their waits then test the requests, spinning briefly and then
napping (mpidist.backoff), so the core goes back to the compute between tests, and each
test still moves the transfer on (it is MPI's progress call). Once nothing computes, the
naps only delay the transfer: while a caller blocks on a worker's result (`hurry`), or
while the worker's own predicate says so (mark_patient's `hurry`: a torch backend group
after backward), the patient waits test without napping, as MPI's blocking waits would;
only where each rank has a core of its own (threads.core_per_rank), since with ranks
sharing cores the polling would take one another rank computes on.

A communicator's collectives come from patient threads on every rank or on none (the
allreduce worker's communicator is its own split, a torch backend group's is called by the
group's worker alone), since the guard (collectives.guard) adds a message where the thread
is patient.
"""
from __future__ import annotations

import contextlib
import threading

from mpi4py import MPI

from mpidist import threads
from mpidist.backoff import Backoff

__all__ = ["mark_patient", "is_patient", "hurry", "waitall", "waitany", "sendrecv"]

_local = threading.local()
_blocked = [0]                  # callers of this process blocked in hurry()
_blocked_lock = threading.Lock()


def mark_patient(hurry=None) -> None:
    """From now on this thread's waits poll with naps (for worker threads beside compute).
    hurry: a predicate; while it is true, the naps are skipped too (nothing computes)."""
    _local.patient = True
    _local.hurry = hurry


def is_patient() -> bool:
    return getattr(_local, "patient", False)


@contextlib.contextmanager
def hurry():
    """Around a caller's blocking wait for what patient threads compute: its core is free
    while it blocks, so their waits skip the naps until it returns."""
    with _blocked_lock:
        _blocked[0] += 1
    try:
        yield
    finally:
        with _blocked_lock:
            _blocked[0] -= 1


def _pause() -> Backoff:
    """The pause between a patient thread's tests."""
    if not threads.core_per_rank():
        return Backoff()
    own = getattr(_local, "hurry", None)
    if own is None:
        return Backoff(hurry=lambda: _blocked[0] > 0)
    return Backoff(hurry=lambda: _blocked[0] > 0 or own())


def waitall(requests) -> None:
    """Complete every request: MPI_Waitall, or on a patient thread Testall with naps."""
    if not is_patient():
        MPI.Request.Waitall(requests)
        return
    pause = _pause()
    while not MPI.Request.Testall(requests):
        pause()


def waitany(requests) -> int:
    """Complete one of requests and return its index (as waitall: inside MPI, or on a
    patient thread Testany with naps); the completed request becomes MPI.REQUEST_NULL."""
    if not is_patient():
        return MPI.Request.Waitany(requests)
    pause = _pause()
    while True:
        index, done = MPI.Request.Testany(requests)
        if done:
            return index
        pause()


def sendrecv(mpi, sendbuf, dest: int, sendtag: int, recvbuf, source: int, recvtag: int) -> None:
    """MPI_Sendrecv on mpi, or on a patient thread its nonblocking halves and waitall."""
    if not is_patient():
        mpi.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag)
        return
    waitall([mpi.Irecv(recvbuf, source, recvtag), mpi.Isend(sendbuf, dest, sendtag)])
