"""The mismatch guard: ranks agree on each collective's signature (kind, length, dtype, op,
algorithm) before any data moves, and raise together, naming the ranks that differ, instead
of hanging in mismatched messages.

Every call is checked, by one MPI_Allreduce of a ballot (ballot.py) holding the signature's
digest d and -d under MAX: max(d) == -max(-d) exactly when every rank has the same d (a rank
with an argument error votes a value no digest takes). A small native host allreduce rides
in the ballot itself (check_reduce), so its check costs no message of its own. Only a
failed check exchanges the full signatures, to say who differs. A call that a worker thread
runs later is checked in two halves: post() starts the vote on the caller's thread (the same
two words by MAX, in point-to-point messages: ballot.Vote), and the worker finishes it when the
call's turn comes; the vote then travels while the calls queued before it still move data, and
the worker goes from one reduction to the next without a round trip between them. On a thread
beside compute (collectives.waits: patient) check() is that vote, posted and finished at once,
waited for with naps, so that a worker whose peers are still in backward does not spin in a
blocking MPI_Allreduce on the core that backward needs. Each checked call goes on the flight
recorder (flight.py), whose watchdog ends a job whose call never finishes.
Modes (env MPIDIST_GUARD or set_mode()): "on" (the default; "first" and "always" are older
names of it) or "off" (no check, no record: a rank with a bad argument then raises alone).
See docs/ARCHITECTURE.md (collectives).
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

from mpidist.collectives import ballot, flight, waits
from mpidist.collectives.flight import describe
from mpidist.errors import MismatchError, RemoteError, format_ranks

__all__ = ["MODES", "set_mode", "get_mode", "check", "check_reduce", "post", "Posted", "explain",
           "describe", "digest"]

MODES = ("on", "off")
_ALIASES = {"1": "on", "0": "off", "first": "on", "always": "on"}
_state = {"mode": None}
_digests: dict = {}             # signature -> its 62-bit digest, the same in every process
_ERROR = 1 << 62                # a rank's vote when its own arguments are wrong


def set_mode(mode: str) -> None:
    """Switch the guard: "on" or "off"."""
    mode = _ALIASES.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"guard mode must be one of {', '.join(MODES)}, got {mode!r}")
    _state["mode"] = mode


def get_mode() -> str:
    if _state["mode"] is None:
        set_mode(os.environ.get("MPIDIST_GUARD", "on").strip().lower() or "on")
    return _state["mode"]


def digest(signature) -> int:
    """A digest of the signature that every process computes alike (Python's hash() of a
    string differs between processes), below 2**62 so that its negation fits an int64."""
    d = _digests.get(signature)
    if d is None:
        raw = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
        d = int.from_bytes(raw, "little") >> 2
        if len(_digests) > 4096:
            _digests.clear()
        _digests[signature] = d
    return d


def check(comm, signature: tuple | None, error: BaseException | None = None, record=None):
    """Collective: raise on every rank if any rank has an argument error or a different
    signature (kind, (name, value), ...). A rank with an error always takes part.

    Returns the call's flight-recorder entry (None with the guard off): the caller passes it
    to flight.end() when the call is complete. record: the communicator whose flight record
    takes the call (default comm; a worker checks on its own split of the caller's).
    """
    mode = _state["mode"] or get_mode()
    if mode == "off":
        if error is not None:
            raise error
        return None
    record = comm if record is None else record
    if comm.size == 1:                          # one rank agrees with itself
        entry = flight.begin(record, signature)
        if error is not None:
            flight.end(entry)
            raise error
        return entry
    if waits.is_patient():                      # the same on every rank: see waits
        return post(comm, signature, error, record).finish()
    b = comm.ballot or ballot.of(comm)          # made (and compiled) before the record
    entry = flight.begin(record, signature)    # from here on a hang is on the record
    d = _ERROR if error is not None else _digests.get(signature) or digest(signature)
    try:
        if not b.vote(d) or error is not None:
            explain(comm.comm, signature, error)
    except BaseException:
        flight.end(entry)
        raise
    return entry


class Posted:
    """A check begun by post(); finish() completes it."""

    __slots__ = ("comm", "signature", "error", "entry", "vote")

    def __init__(self, comm, signature, error, entry, vote=None):
        self.comm, self.signature, self.error, self.entry = comm, signature, error, entry
        self.vote = vote

    def finish(self, explain_on=None):
        """Wait for the vote (with naps on a patient thread) and raise on every rank as
        check() does; returns the call's flight entry. explain_on: the mpi4py communicator
        on which the ranks exchange their signatures after a failed vote (default the
        vote's own; a thread that does not post on that one names its own)."""
        if self.vote is None:                   # the guard off, or one rank
            if self.error is not None:
                flight.end(self.entry)
                raise self.error
            return self.entry
        try:
            if not self.vote.wait() or self.error is not None:
                explain(self.comm.comm if explain_on is None else explain_on,
                        self.signature, self.error)
        except BaseException:
            flight.end(self.entry)
            raise
        return self.entry


def post(comm, signature: tuple | None, error: BaseException | None = None,
         record=None) -> Posted:
    """check() begun without waiting for the other ranks: the vote goes out now
    (ballot.Vote, point-to-point messages on comm) and Posted.finish() completes it, on
    this thread or on the one that runs the call. Collective: every rank posts its checks
    on comm in the same order, from one thread, and finishes them in that order."""
    mode = _state["mode"] or get_mode()
    record = comm if record is None else record
    if mode == "off" or comm.size == 1:
        return Posted(comm, signature, error, None if mode == "off" else
                      flight.begin(record, signature))
    entry = flight.begin(record, signature)
    d = _ERROR if error is not None else digest(signature)
    try:
        vote = ballot.Vote(comm.comm, d)
    except BaseException:
        flight.end(entry)
        raise
    return Posted(comm, signature, error, entry, vote)


def check_reduce(comm, signature: tuple | None, error, x, y, op):
    """check() for an allreduce of x into y by op, which also reduces x in the same message
    where it fits the ballot (Ballot.vote_reduce). The signature fixes x's length, dtype
    and op, so whether host data can ride is worked out once per signature. Returns
    (entry, k): k == x.size when y holds the result, else 0 (the guard off, an argument
    error, data that did not ride) and the caller reduces x."""
    if error is not None or comm.size == 1 or (_state["mode"] or get_mode()) == "off":
        return check(comm, signature, error), 0
    b = comm.ballot or ballot.of(comm)
    host = type(x) is np.ndarray and type(y) is np.ndarray
    plan = b.plans.get(signature) if host else None
    if plan is None:
        plan = (digest(signature), b.meta(x, y, op))
        if host:
            if len(b.plans) > 4096:
                b.plans.clear()
            b.plans[signature] = plan
    d, meta = plan
    if meta is None:
        return check(comm, signature), 0
    entry = flight.begin(comm, signature)
    try:
        k = b.vote_reduce(d, x, y, op, meta)
        if k < 0:
            explain(comm.comm, signature, None)
    except BaseException:
        flight.end(entry)
        raise
    return entry, k


def explain(mpi_comm, signature, error) -> None:
    """Collective over an mpi4py communicator, after a failed check (a ballot here, a node
    window's digests): exchange the signatures and raise on every rank, naming who differs."""
    msg = None if error is None else f"{type(error).__name__}: {error}"
    values = mpi_comm.allgather((signature, msg))
    bad = [r for r, (_, m) in enumerate(values) if m is not None]
    if bad:
        if error is not None:
            raise error
        detail = "; ".join(f"rank {r}: {values[r][1]}" for r in bad)
        raise RemoteError(f"collective arguments rejected on rank(s) {format_ranks(bad)}: {detail}")
    groups: dict = {}
    for r, (sig, _) in enumerate(values):
        groups.setdefault(sig, []).append(r)
    detail = "; ".join(f"ranks {format_ranks(rs)}: {describe(sig)}" for sig, rs in groups.items())
    raise MismatchError(f"ranks disagree on the collective call ({detail}); every rank must make "
                        f"the same calls, in the same order, with the same length, dtype and op")
