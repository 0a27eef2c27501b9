"""The mismatch guard: ranks agree on each collective's signature (kind, length, dtype, op,
algorithm) before any data moves, and raise together, naming the ranks that differ, instead
of hanging in mismatched messages.

Every call is checked, so a differing length, dtype, op, algorithm, kind of collective or
call order is caught on any call, not only the first of a signature. The check is one
fixed-size message per call, the same MPI call whatever the collective (so mismatched
calls still meet), chosen by the communicator's size (CARRY):
  - up to 8 ranks, an MPI_Allgather of a block per rank: the signature's digest, and for a
    small allreduce the data itself, which each rank then reduces from the gathered blocks
    in rank order (the same bits everywhere): such a call sends nothing else;
  - beyond, a two-word integer MPI_Allreduce (MAX) of the digest d and -d: max(d) ==
    -max(-d) exactly when every rank has the same d.
A rank with an argument error sends a value no digest takes. Only when the check fails do
the ranks exchange their full signatures to say who differs.

Each checked call is entered in the flight recorder (flight.py), whose watchdog ends a job
whose call never finishes (a rank that skipped a call leaves no signature to compare).

Modes (env MPIDIST_GUARD or set_mode()): "on" (default) checks and records every call; "off"
does neither (a rank with a bad argument then raises alone). "first" and "always" are
accepted as older names of "on".
"""
from __future__ import annotations

import array
import hashlib
import os
import threading

import numpy as np
from mpi4py import MPI

from mpidist.collectives import flight
from mpidist.collectives.flight import describe
from mpidist.errors import MismatchError, RemoteError, format_ranks

__all__ = ["MODES", "set_mode", "get_mode", "check", "check_carrying", "carry_bytes", "describe",
           "CARRY"]

MODES = ("on", "off")
_ALIASES = {"1": "on", "0": "off", "first": "on", "always": "on"}
_state = {"mode": None}
_digests: dict = {}             # signature -> its 62-bit digest, the same in every process
_ERROR = 1 << 62                # a rank's vote when its own arguments are wrong
# (up to this many ranks, data bytes a rank's check block carries): the allgathered block is
# 8 + that many bytes; past the last row, the two-word allreduce (the block would grow with
# the ranks while a small allreduce gains nothing from it)
CARRY = ((8, 1024),)
_DIGEST = 8
_buffers = threading.local()    # each thread's check buffers, per communicator size


def carry_bytes(size: int) -> int:
    """The data bytes the check carries on a communicator of `size` ranks (0: none, and the
    check is the two-word allreduce)."""
    for upto, nbytes in CARRY:
        if size <= upto:
            return nbytes
    return 0


class _Blocks:
    """One thread's buffers for checks on communicators of one size: the block it sends, the
    blocks it receives, and views of them per (bytes, dtype) of carried data."""

    def __init__(self, size: int):
        self.carry = carry_bytes(size)
        if self.carry:
            width = _DIGEST + self.carry
            self.send = np.zeros(width, np.uint8)
            self.recv = np.zeros((size, width), np.uint8)
            self.digests = self.recv.view(np.int64)[:, 0]
            self.mine = self.send.view(np.int64)
            self.bytes = memoryview(self.send)
            # the MPI datatype given, so that mpi4py need not work it out on each call
            self.message = ([self.send, MPI.BYTE], [self.recv, MPI.BYTE])
        else:
            self.votes = array.array("q", (0, 0))
        self.views: dict = {}

    def carried(self, nbytes: int, dtype):
        """Every rank's carried data as a (size, n) array of dtype (rows in rank order)."""
        key = (nbytes, dtype.num)
        rows = self.views.get(key)
        if rows is None:
            rows = self.views[key] = self.recv[:, _DIGEST:_DIGEST + nbytes].view(dtype)
        return rows


def _blocks(size: int) -> _Blocks:
    per_size = _buffers.__dict__.get("per_size")
    if per_size is None:
        per_size = _buffers.per_size = {}
    b = per_size.get(size)
    if b is None:
        b = per_size[size] = _Blocks(size)
    return b


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


def _digest(signature) -> int:
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


def check(comm, signature: tuple | None, error: BaseException | None = None):
    """Collective: raise on every rank if any rank has an argument error or a different
    signature (kind, (name, value), ...). A rank with an error always takes part.

    Returns the call's flight-recorder entry (None with the guard off): the caller passes it
    to flight.end() when the call is complete.
    """
    return check_carrying(comm, signature, error)[0]


def check_carrying(comm, signature: tuple | None, error: BaseException | None = None,
                   data=None):
    """check(), sending `data` (a flat NumPy array of at most carry_bytes(comm.size) bytes,
    or None) with the check. Returns (entry, rows): rows is every rank's data as a (size, n)
    array, in rank order, when it came with the check (valid until this thread's next check
    on a communicator of this size), else None.
    """
    mode = _state["mode"] or get_mode()
    if mode == "off":
        if error is not None:
            raise error
        return None, None
    entry = flight.begin(comm, signature)      # from here on a hang is on the record
    if comm.size == 1:                          # one rank agrees with itself
        if error is not None:
            flight.end(entry)
            raise error
        return entry, None
    d = _ERROR if error is not None else _digests.get(signature) or _digest(signature)
    b = _blocks(comm.size)
    rows = None
    try:
        if b.carry:
            b.mine[0] = d
            if data is not None and error is None:
                b.bytes[_DIGEST:_DIGEST + data.nbytes] = data.data.cast("B")
                rows = b.carried(data.nbytes, data.dtype)
            comm.comm.Allgather(*b.message)
            agreed = b.digests.tolist().count(d) == comm.size
        else:
            votes = b.votes
            votes[0], votes[1] = d, -d
            comm.comm.Allreduce(MPI.IN_PLACE, votes, MPI.MAX)
            agreed = votes[0] == -votes[1]
        if not agreed or error is not None:
            _explain(comm, signature, error)
    except BaseException:
        flight.end(entry)
        raise
    return entry, rows


def _explain(comm, signature, error) -> None:
    """Collective, after a failed check: exchange the signatures and raise on every rank."""
    msg = None if error is None else f"{type(error).__name__}: {error}"
    values = comm.comm.allgather((signature, msg))
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
