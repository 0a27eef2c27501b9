"""The node's shared window: memory every rank of one node reads, a barrier of counters in
it, and the mismatch guard carried by that barrier.

Each rank has a header line (its barrier counter, the digests it voted, a count of flags)
and a data slice, in two MPI shared windows: the data window grows without touching the
counters. The barrier: each rank raises its counter, then polls the others' a few times and
sleeps between polls (mpidist.backoff), so a waiting rank leaves its core to the ranks it
waits for; an MPI barrier would spin on it. A barrier may carry a digest of the call's
signature (guard.digest): the ranks compare them once every rank has arrived, and when they
differ guard.explain names who differs, on every rank.
"""
from __future__ import annotations

import threading
import time
import weakref

import numpy as np
from mpi4py import MPI

from mpidist import ulfm
from mpidist.backoff import Backoff
from mpidist.collectives import flight, guard
from mpidist.comm import on_free

__all__ = ["Window", "window_of", "usable"]

_LINE = 64        # bytes of a rank's header line: counter, two digests (by parity), flags
_COUNTER, _FLAGS = 0, 3
_ERROR = -1       # the digest of a rank with an argument error (digests are >= 0)
_BLOCK_BYTES = 256 << 10            # a reduction's block: the running result stays in cache
_windows: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def usable(comm) -> bool:
    """One node (not simulated as several), more than one rank, and no fault tolerance
    (ULFM does not cover shared-memory windows: a dead rank would hang the others)."""
    return comm.size > 1 and comm.num_nodes == 1 and not ulfm.active()


class Window:
    """The shared window of the ranks of `comm` (an mpidist Communicator whose ranks share a
    node), on a duplicate of its MPI communicator. Collective construction; used by one
    thread at a time, and every rank makes the same calls on it in the same order.

    regions: how many data regions the calls cycle through (slices): with two, a call's
    region is written again only after the first barrier of the call in between, which
    every rank passes only once it has finished reading it; so a call needs one barrier
    between its writes and its reads, none after. A window of one region serves a buffer
    that stays in place (SharedBuffer), whose callers separate the calls with barriers.
    """

    def __init__(self, comm, regions: int = 2):
        self.comm = comm                # whose flight record takes the checks
        self._mpi = comm.comm.Dup()
        self.rank, self.size = comm.rank, comm.size
        self._regions, self._region, self._capacity = regions, 0, 0
        self._data, self._raw, self._block = None, [], None
        self._head = MPI.Win.Allocate_shared(_LINE, 1, comm=self._mpi)
        self._head.Lock_all(MPI.MODE_NOCHECK)
        self._lines = [np.frombuffer(self._head.Shared_query(r)[0], np.int64)[:_LINE // 8]
                       for r in range(self.size)]
        self._lines[self.rank][:] = 0
        self.seq = 0                    # the barriers this rank has arrived at
        self._mpi.Barrier()

    # ------------------------------------------------------------------ the barrier
    def arrive(self, digest: int | None = None) -> int:
        """My side of the next barrier: the digest in its slot, then my counter raised.
        Returns the slot (for agreed)."""
        self.seq += 1
        mine = self._lines[self.rank]
        slot = 1 + self.seq % 2                         # a rank two barriers ahead is
        if digest is not None:                          # past my reading of this one
            mine[slot] = digest
        self._head.Sync()
        mine[_COUNTER] = self.seq
        return slot

    def wait(self, seq: int, patience: float | None = None) -> bool:
        """Whether every rank has arrived at barrier seq, waiting at most `patience`
        seconds (None: until they have); their writes before it are visible after True."""
        deadline = None if patience is None else time.perf_counter() + patience
        for line in self._lines:
            wait = Backoff(deadline)
            while line[_COUNTER] < seq:
                if not wait():
                    return False
        self._head.Sync()
        return True

    def arrivals(self, seq: int):
        """The other ranks, each as it arrives at barrier seq (waiting as wait does), so the
        caller works on one while the others are still on their way."""
        pending = [j for j in range(self.size) if j != self.rank]
        wait = Backoff()
        while pending:
            ready = [j for j in pending if self._lines[j][_COUNTER] >= seq]
            if ready:
                self._head.Sync()                       # their writes before the counter
                for j in ready:
                    pending.remove(j)
                    yield j
                continue
            wait()

    def agreed(self, slot: int, digest: int | None) -> bool:
        """After every rank arrived: whether they all wrote my digest in the slot."""
        return digest is None or all(line[slot] == digest for line in self._lines)

    def barrier(self) -> None:
        """Make my stores visible, wait for every rank, then see theirs."""
        self.arrive()
        self.wait(self.seq)

    # ------------------------------------------------------------------ the guard
    def agree(self, signature, error: BaseException | None = None) -> None:
        """A barrier that is the mismatch guard: raise on every rank when any rank has an
        argument error or a different signature (None: the caller's error)."""
        digest = _ERROR if error is not None or signature is None else guard.digest(signature)
        slot = self.arrive(digest)
        self.wait(self.seq)
        if error is not None or not self.agreed(slot, digest):
            self.disagree(signature, error)

    def check(self, signature, error: BaseException | None = None) -> list:
        """agree() on the flight record: returns the entry for flight.end()."""
        entry = flight.begin(self.comm, signature)
        try:
            self.agree(signature, error)
        except BaseException:
            flight.end(entry)
            raise
        return entry

    def disagree(self, signature, error) -> None:
        """Every rank saw the digests differ: raise on every rank, naming who differs."""
        guard.explain(self._mpi, signature, error)

    # ------------------------------------------------------------------ the data
    def fits(self, nbytes: int) -> bool:
        """Whether a call on nbytes needs no growth of the window (no collective step)."""
        return self._data is not None and nbytes <= self._capacity

    def slices(self, n: int, dtype) -> list[np.ndarray]:
        """Every rank's n elements of dtype in the next region. Collective when they do not
        fit: every rank grows the window in the same call (its callers agree on n first)."""
        dtype = np.dtype(dtype)
        nbytes = n * dtype.itemsize
        if nbytes > self._capacity or self._data is None:
            self._grow(-(-max(nbytes, 2 * self._capacity, _LINE) // _LINE) * _LINE)
        self._region = (self._region + 1) % self._regions
        at = self._region * self._capacity
        return [raw[at:at + nbytes].view(dtype) for raw in self._raw]

    def _grow(self, capacity: int) -> None:
        if self._data is not None:      # Win_free waits for every rank: none reads it still
            self._data.Unlock_all()
            self._data.Free()
        self._capacity = capacity
        total = self._regions * capacity
        self._data = MPI.Win.Allocate_shared(total, 1, comm=self._mpi)
        self._data.Lock_all(MPI.MODE_NOCHECK)
        self._raw = [np.frombuffer(self._data.Shared_query(r)[0], np.uint8)[:total]
                     for r in range(self.size)]

    def block(self, dtype) -> np.ndarray:
        """The window's scratch block of dtype, for a reduction's running result."""
        if self._block is None:
            self._block = np.empty(_BLOCK_BYTES, np.uint8)
        return self._block.view(dtype)

    def flag(self) -> None:
        """Count one flag of mine (SharedBuffer: a chunk whose sum is not finite); the
        others read it after my next barrier."""
        self._lines[self.rank][_FLAGS] += 1

    def flags(self) -> int:
        """Every rank's flags so far, added up (after a barrier: the same on every rank)."""
        return sum(int(line[_FLAGS]) for line in self._lines)

    def free(self) -> None:
        """Collective: free the windows and the duplicate communicator."""
        if self._mpi is None:
            return
        # MPI_Win_free waits for every rank of the window: ranks that hold different
        # windows would wait for ever, so they compare first and raise instead
        views = self._mpi.allgather((self._data is not None, self._capacity, self.seq))
        if len({v[:2] for v in views}) > 1:
            raise RuntimeError(
                "the node window differs between ranks at free (rank: (data window, "
                "capacity, barriers)): " + ", ".join(f"{r}: {v}" for r, v in enumerate(views)))
        # one line each, so that a stack taken in a hang shows which window a rank frees
        if self._data is not None:
            self._data.Unlock_all()
            self._data.Free()
        if self._head is not None:
            self._head.Unlock_all()
            self._head.Free()
        self._data = self._head = None
        self._raw, self._lines = [], []
        self._mpi.Free()
        self._mpi = None

    @property
    def freed(self) -> bool:
        return self._mpi is None


def window_of(comm) -> Window:
    """comm's own Window, made on first use (collective then), freed with comm."""
    w = _windows.get(comm)
    if w is not None:
        return w
    w = Window(comm)                    # every rank of comm makes it in the same call
    with _lock:
        return _windows.setdefault(comm, w)


def _release(comm) -> None:
    """Free comm's window (collective, from Communicator.free on every rank)."""
    with _lock:
        w = _windows.pop(comm, None)
    if w is not None:
        w.free()


on_free(_release)
