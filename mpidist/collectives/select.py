"""Choosing an algorithm for algorithm="auto"."""
from __future__ import annotations

__all__ = ["choose"]


def choose(comm, nbytes: int) -> str:
    """The algorithm for an allreduce of nbytes on comm (the same on every rank)."""
    if comm.size == 1 or nbytes < (64 << 10):
        return "native"
    return "ring"
