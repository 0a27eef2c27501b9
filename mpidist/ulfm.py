"""ULFM at the level of mpidist's Communicator: detect a process failure, revoke, shrink.

Open MPI 5 runs ULFM when started with `mpiexec --with-ft ulfm` (its mpiexec then sets
OMPI_MCA_mpi_ft_enable=1 in every rank); mpi4py exposes Comm.Revoke and Comm.Shrink. With
ULFM, an operation that involves a dead rank raises MPI_ERR_PROC_FAILED on the ranks that
notice, and revoking a communicator makes every pending and later operation on it raise
MPI_ERR_REVOKED everywhere, so no survivor stays blocked waiting for a live rank that left
the collective. Shrink() then gives the survivors' communicator, agreed among them.

ULFM counts as active where the launcher switched it on (mpilib.ulfm_switched_on: Open
MPI's or MPICH's variable) and mpi4py has the API (Comm.Shrink and the failure error
classes), so MPICH's ULFM counts as Open MPI's does. This module sits beside comm.py, below
the collectives, which ask it whether ULFM is active; the recovery protocol (mpidist.ft)
uses it from above.

What ULFM does not cover: one-sided RMA (shared-memory windows, the parameter server) and
MPI-IO, so in FT mode `auto` never picks the `shm` allreduce and checkpoints take the
writer without MPI-IO.
See docs/ARCHITECTURE.md (fault tolerance).
"""
from __future__ import annotations

import os
import time

from mpi4py import MPI

from mpidist import mpilib
from mpidist.comm import Communicator
from mpidist.errors import flush_output

__all__ = ["active", "failure_of", "broken", "revoke", "shrink", "world_ranks", "exit_now"]

_FAILURE_CLASSES = tuple(getattr(MPI, name) for name in
                         ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                         if hasattr(MPI, name))


def active() -> bool:
    """True in a job started with ULFM on (Open MPI's `mpiexec --with-ft ulfm`, MPICH's
    MPIR_CVAR_ENABLE_FT=1) by an MPI whose mpi4py has the ULFM calls and error classes."""
    return mpilib.ulfm_switched_on() and hasattr(MPI.Comm, "Shrink") and bool(_FAILURE_CLASSES)


def failure_of(exc: BaseException | None) -> "MPI.Exception | None":
    """The MPI process-failure or revoked error behind exc (its cause/context chain), or None.

    A Waitall over several requests reports MPI_ERR_IN_STATUS; with ULFM active that is
    taken as a failure too (the agreement that follows finds out who failed)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MPI.Exception):
            cls = exc.Get_error_class()
            if cls in _FAILURE_CLASSES or (cls == MPI.ERR_IN_STATUS and active()):
                return exc
        exc = exc.__cause__ or exc.__context__
    return None


def broken(comm, wait: float = 0.0) -> bool:
    """Does this process know of a dead rank in comm (a Communicator), or is comm revoked?
    Local; polls up to `wait` seconds for the news to arrive.

    Under a failure a collective can also end in garbage rather than an MPI error (seen:
    mpi4py's pickled allgather unpickling a buffer a dead rank never filled), so an error
    that is not an MPI failure is checked against this before it is taken for a bug."""
    deadline = time.monotonic() + wait
    while True:
        try:
            if comm.comm.Is_revoked():
                return True
            group = comm.comm.Get_failed()
            dead = group.Get_size()
            group.Free()
            if dead:
                return True
        except MPI.Exception:
            return True
        except AttributeError:           # an mpi4py without ULFM
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def revoke(comm) -> None:
    """Revoke every MPI communicator of comm (a Communicator): all their pending and later
    operations fail on every rank (local; errors of already revoked ones are ignored)."""
    for c in comm.communicators():
        try:
            c.Revoke()
        except MPI.Exception:
            pass


def world_ranks(mpi_comm: MPI.Comm, ranks: list[int]) -> list[int]:
    """ranks of mpi_comm as ranks of MPI.COMM_WORLD (the numbers the job was started with)."""
    group, world = mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, list(ranks), world)]
    finally:
        group.Free()
        world.Free()


def shrink(comm):
    """Collective over the survivors of comm (a Communicator): revoke it, shrink it and build
    a Communicator over the survivors (a failure during that is shrunk away too).

    Returns (new Communicator, lost ranks as COMM_WORLD ranks). comm is freed: what the
    collectives cached for it goes, its revoked MPI communicators are released."""
    revoke(comm)
    mpi = comm.comm
    members = world_ranks(mpi, range(mpi.Get_size()))
    while True:
        small = mpi.Shrink()
        small.Set_errhandler(MPI.ERRORS_RETURN)
        alive = set(world_ranks(small, range(small.Get_size())))
        try:
            new = Communicator(small)
            new.comm.Barrier()
        except MPI.Exception as exc:
            if failure_of(exc) is None:
                raise
            small.Revoke()
            if mpi is not comm.comm:
                mpi.Free()
            mpi = small
            continue
        small.Free()
        if mpi is not comm.comm:
            mpi.Free()
        break
    comm.free()
    return new, sorted(set(members) - alive)


def exit_now(code: int) -> None:
    """End this process with `code` without MPI_Finalize, after the job has closed its files.

    After successive rank failures Open MPI 5.0's MPI_Finalize sometimes never returns (a
    race in its shutdown; a plain mpi4py loop shows it too), which would turn a finished job
    into a hung one; a survivor that leaves without it is taken as a normal exit by mpiexec
    --with-ft ulfm."""
    flush_output()
    os._exit(int(code))
