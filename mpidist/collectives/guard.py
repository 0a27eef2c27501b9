"""The mismatch guard: before a collective, ranks exchange its signature (kind, length,
dtype, op, algorithm) and any local argument error, and all raise together when they
disagree, naming the ranks that differ, instead of hanging in mismatched messages.

Modes (env MPIDIST_GUARD or set_mode()):
  "first"  (default) check the first call of each signature on a communicator; a steady
           training loop then pays nothing. Ranks that agreed so far have seen the same
           signatures, so they take the same decision about checking.
  "always" check every call (one small allgather each): also catches a later change of
           call order between signatures already seen.
  "off"    never check.
"""
from __future__ import annotations

import os
import threading
import weakref

from mpidist.errors import MismatchError, RemoteError

__all__ = ["MODES", "set_mode", "get_mode", "check", "checked", "describe"]

MODES = ("first", "always", "off")
_state = {"mode": None}
_seen: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_last: tuple = (None, None)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], 0
    for i, r in enumerate(ranks):
        if i == 0 or r != ranks[i - 1] + 1:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(r) if start == r else f"{start}-{r}")
    return ",".join(out)


def set_mode(mode: str) -> None:
    """Switch the guard: "first", "always" or "off"."""
    if mode not in MODES:
        raise ValueError(f"guard mode must be one of {', '.join(MODES)}, got {mode!r}")
    _state["mode"] = mode


def get_mode() -> str:
    if _state["mode"] is None:
        mode = os.environ.get("MPIDIST_GUARD", "first").strip().lower() or "first"
        set_mode({"1": "first", "0": "off"}.get(mode, mode))
    return _state["mode"]


def checked(comm) -> frozenset:
    """The signatures already checked on comm (the "first" mode skips these), described."""
    with _lock:
        return frozenset(describe(s) for s in _seen.get(comm, ()))


def describe(signature) -> str:
    """('allreduce', ('n', 5), ('op', 'sum')) -> 'allreduce(n=5, op=sum)'."""
    if signature is None:
        return "(no call)"
    kind, *fields = signature
    return f"{kind}({', '.join(f'{k}={v}' for k, v in fields)})"


def check(comm, signature: tuple | None, error: BaseException | None = None) -> None:
    """Collective (when checking): raise on every rank if any rank has an argument error or
    a different signature (kind, (name, value), ...). A rank with an error always takes
    part in the exchange."""
    global _last
    mode = _state["mode"] or get_mode()
    last = _last                       # (comm, its seen set): a loop calls on one comm
    if last[0] is comm:
        seen = last[1]
    else:
        with _lock:
            seen = _seen.setdefault(comm, set())
        _last = (comm, seen)
    if error is None and (mode == "off" or (mode == "first" and signature in seen)):
        return
    if mode == "off":
        raise error
    msg = None if error is None else f"{type(error).__name__}: {error}"
    values = comm.comm.allgather((signature, msg))
    bad = [r for r, (_, m) in enumerate(values) if m is not None]
    if bad:
        if error is not None:
            raise error
        detail = "; ".join(f"rank {r}: {values[r][1]}" for r in bad)
        raise RemoteError(f"collective arguments rejected on rank(s) {_ranges(bad)}: {detail}")
    groups: dict = {}
    for r, (sig, _) in enumerate(values):
        groups.setdefault(sig, []).append(r)
    if len(groups) > 1:
        detail = "; ".join(f"ranks {_ranges(rs)}: {describe(sig)}" for sig, rs in groups.items())
        raise MismatchError(f"ranks disagree on the collective call ({detail}); every rank "
                            f"must make the same calls, in the same order, with the same "
                            f"length, dtype and op")
    with _lock:
        seen.add(signature)
