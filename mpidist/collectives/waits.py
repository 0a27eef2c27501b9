"""How a thread waits for its MPI requests: inside MPI, or polling with naps.

A rank's own thread waits inside MPI (Wait, Sendrecv): with a core to itself, that answers
soonest. A worker thread that reduces gradient buckets while backward runs on the same
cores must not: MPI's blocking waits poll without pause, and each polling worker takes a
core from the compute it is meant to overlap (across nodes, where a bucket's transfer
takes milliseconds, it would take it for all of them). Threads that run beside compute
call mark_patient() once; their waits then test the requests, spinning briefly and then
napping (mpidist.backoff), so the core goes back to the compute between tests, and each
test still moves the transfer on (it is MPI's progress call).

A communicator's collectives come from patient threads on every rank or on none (the
allreduce worker's communicator is its own split, a torch backend group's is called by the
group's worker alone), since the guard (collectives.guard) adds a message where the thread
is patient.
"""
from __future__ import annotations

import threading

from mpi4py import MPI

from mpidist.backoff import Backoff

__all__ = ["mark_patient", "is_patient", "waitall", "waitany", "sendrecv"]

_local = threading.local()


def mark_patient() -> None:
    """From now on this thread's waits poll with naps (for worker threads beside compute)."""
    _local.patient = True


def is_patient() -> bool:
    return getattr(_local, "patient", False)


def waitall(requests) -> None:
    """Complete every request: MPI_Waitall, or on a patient thread Testall with naps."""
    if not is_patient():
        MPI.Request.Waitall(requests)
        return
    pause = Backoff()
    while not MPI.Request.Testall(requests):
        pause()


def waitany(requests) -> int:
    """Complete one of requests and return its index (as waitall: inside MPI, or on a
    patient thread Testany with naps); the completed request becomes MPI.REQUEST_NULL."""
    if not is_patient():
        return MPI.Request.Waitany(requests)
    pause = Backoff()
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
