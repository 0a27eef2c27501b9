"""Exceptions that mpidist raises on every rank at once, so no rank is left waiting, the one
way their messages name ranks, and `agree_or_raise`: the one collective that turns a failure
on some ranks into an exception on all of them, and `abort_job`: the one way a rank ends the
whole job when it cannot tell the others.

This module imports nothing of mpidist, so every layer can use it.
"""

import faulthandler
import logging
import os
import sys

__all__ = ["format_ranks", "format_failures", "agree_or_raise", "abort_job", "flush_output",
           "MismatchError", "RemoteError", "ConfigError"]

ABORT_GRACE = 5.0      # seconds MPI_Abort gets before this rank leaves on its own


def format_ranks(ranks) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (sorted ranks)."""
    out, start = [], None
    ranks = list(ranks)
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def format_failures(failures) -> str:
    """[(rank, type name, message)] -> 'failed on rank(s) 0-2: ValueError: bad; rank(s) 3: ...'
    (ranks with the same error grouped)."""
    groups: dict = {}
    for rank, kind, message in failures:
        groups.setdefault(f"{kind}: {message}", []).append(rank)
    return "failed on " + "; ".join(f"rank(s) {format_ranks(rs)}: {m}" for m, rs in groups.items())


class MismatchError(ValueError):
    """Ranks disagree on something that must be identical (length, dtype, op, call order)."""


class RemoteError(RuntimeError):
    """Another rank failed; raised on the ranks that did not, naming the ranks that did."""


class ConfigError(ValueError):
    """A job configuration is invalid; raised before any work starts."""


def agree_or_raise(comm, exc, remote: type = RemoteError, *, share=None) -> list:
    """Collective: if any rank of comm passes an exception, raise on every rank.

    comm: an mpidist Communicator (or an mpi4py communicator); exc: this rank's failure or
    None. The failing ranks re-raise their own exception; the others raise `remote`
    (RemoteError, or a class the caller's handlers catch, so every rank takes the same
    branch) with format_failures' message. The raised exception's `failures` attribute
    lists (rank, type name, message) of every failing rank.
    share: a small picklable value of this rank that travels in the same exchange (metadata
    a caller compares across ranks next). Returns every rank's share, by rank, where no rank
    failed.
    """
    mpi_comm = getattr(comm, "comm", comm)
    mine = None if exc is None else (type(exc).__name__, str(exc))
    views = mpi_comm.allgather((mine, share))
    failures = [(r, *f) for r, (f, _) in enumerate(views) if f is not None]
    if not failures:
        return [s for _, s in views]
    if exc is not None:
        try:
            exc.failures = failures
        except AttributeError:      # an exception type with __slots__
            pass
        raise exc
    err = remote(format_failures(failures))
    err.failures = failures
    raise err


def flush_output() -> None:
    """Flush the logs and the standard streams, before this process leaves abruptly."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def abort_job(comm, code: int = 1):
    """End the whole job from this rank: MPI_Abort on `comm` (an mpidist Communicator or an
    mpi4py communicator; this module leaves importing mpi4py, which starts MPI, to callers).

    MPI_Abort does not always return or end the job: Open MPI 5 with a rank already lost
    sometimes waits in it forever, holding the GIL. faulthandler's watchdog, a C thread
    that needs no GIL, then ends this rank with exit status 1 after ABORT_GRACE seconds;
    the launcher takes that exit as the job's end, and a rank still running sees this one
    gone at its next call. Logs and streams are flushed first, so the reason is kept. Under
    the launcher's `--ft` the code also goes to the file MPIDIST_ABORT_NOTE names, which
    makes it the job's exit status however mpiexec ends (mpidist.launcher)."""
    note = os.environ.get("MPIDIST_ABORT_NOTE")
    if note:
        try:
            with open(note, "a") as fh:
                fh.write(f"{int(code)}\n")
        except OSError:
            pass
    flush_output()
    faulthandler.dump_traceback_later(ABORT_GRACE, exit=True, file=open(os.devnull, "w"))
    getattr(comm, "comm", comm).Abort(code)
