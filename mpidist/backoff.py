"""Waiting for a value another process writes: poll, then sleep, doubling.

A rank that waits for a counter in a shared-memory window (the barrier of the node window,
collectives.node) or in an RMA window (the parameter server) polls it. The
first polls spin, since the answer is usually microseconds away; after them each failed poll
sleeps, doubling up to a cap, so that a waiting rank leaves its core to the ranks it waits
for (with more ranks than cores they share one). An MPI barrier would spin on that core
instead. A deadline turns a wait that may never end into an answer the caller acts on, and
a `hurry` predicate skips the sleeps while it holds (no compute waits for the core).
"""
from __future__ import annotations

import time

__all__ = ["Backoff", "SPINS", "FIRST_NAP", "LONGEST_NAP"]

SPINS = 64              # polls before the first sleep
FIRST_NAP = 20e-6       # the first sleep (seconds), doubled at each failed poll after it
LONGEST_NAP = 200e-6    # the cap of that doubling (seconds)


class Backoff:
    """The pause after each failed poll: call it once per poll that did not find the value.

    None for the first `spins` polls, then sleeps from FIRST_NAP doubling up to `longest`,
    except while `hurry()` is true (then it returns at once, as in the first polls).
    Returns False, without sleeping, once a poll after the first `spins` is past `deadline`
    (a time.perf_counter() value; None: never)."""

    def __init__(self, deadline: float | None = None, *, spins: int = SPINS,
                 longest: float = LONGEST_NAP, hurry=None):
        self.deadline, self.spins, self.longest, self.hurry = deadline, spins, longest, hurry
        self.polls, self.nap = 0, FIRST_NAP

    def __call__(self) -> bool:
        self.polls += 1
        if self.polls > self.spins:
            if self.deadline is not None and time.perf_counter() > self.deadline:
                return False
            if self.hurry is None or not self.hurry():
                time.sleep(self.nap)
                self.nap = min(2 * self.nap, self.longest)
        return True
