"""A shared int64 counter in one rank's window: any rank takes the next value with one
atomic Fetch_and_op, without the host's code taking part (passive target, Lock_all).

Asynchronous DiLoCo hands out its rounds with it: a group claims the next round when it
finishes one, so fast groups take more of the budget and nobody waits for a slow group.
The host should be a rank that stays inside MPI (a parameter server polling its windows),
so that implementations that progress one-sided operations in software answer at once.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

__all__ = ["SharedCounter"]


class SharedCounter:
    """Collective over comm (an mpi4py communicator) to create and to free."""

    def __init__(self, comm: MPI.Comm, host: int, value: int = 0):
        self.host = int(host)
        mine = comm.Get_rank() == self.host
        self.win = MPI.Win.Allocate(8 if mine else 0, 8, comm=comm)
        if mine:
            self.win.Lock(self.host, MPI.LOCK_EXCLUSIVE)
            np.frombuffer(self.win.tomemory(), dtype=np.int64, count=1)[0] = int(value)
            self.win.Unlock(self.host)
        comm.Barrier()        # nobody reads the word before the host has set it
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self._one = np.ones(1, np.int64)
        self._old = np.zeros(1, np.int64)

    def add(self, amount: int = 1) -> int:
        """Atomically add amount; returns the value before (one round trip to the host)."""
        self._one[0] = amount
        self.win.Fetch_and_op(self._one, self._old, self.host, 0, MPI.SUM)
        self.win.Flush(self.host)
        return int(self._old[0])

    def set(self, value: int) -> None:
        """Atomically store value (a restore; the caller orders it before any add)."""
        self.win.Accumulate([np.array([value], np.int64), MPI.INT64_T], self.host, (0, 1, MPI.INT64_T),
                            MPI.REPLACE)
        self.win.Flush(self.host)

    def read(self) -> int:
        return self.add(0)

    @property
    def freed(self) -> bool:
        return self.win is None

    def free(self) -> None:
        """Collective; idempotent."""
        if self.win is not None:
            win, self.win = self.win, None
            try:
                win.Unlock_all()
            finally:
                win.Free()
