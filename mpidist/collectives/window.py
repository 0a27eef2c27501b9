"""A flat buffer that lives in a node's shared-memory window, reduced where it lies.

The shared-memory allreduce (shm.py) first copies each rank's input into a window slice;
an array allocated in the window to begin with (a gradient buffer that backward writes into
directly) needs no such copy. Each range is reduced by the rank that owns its chunk, in
rank order (every rank ends with the same bits), on a worker thread of the buffer's own,
so that reductions overlap the caller's work. Waits poll counters in the window with short
sleeps: an MPI barrier would poll a core that the caller's compute still needs. Float32
and float64 only (half precision needs wider sums: use the collectives, which widen).
The phases: SharedBuffer; see docs/ARCHITECTURE.md (collectives).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from mpi4py import MPI

from mpidist.backoff import Backoff
from mpidist.collectives import flight, shm
from mpidist.collectives.handle import Handle
from mpidist.comm import as_communicator
from mpidist.kernels.grads_cpu import sum_finite
from mpidist.partition import counts_displs

__all__ = ["SharedBuffer", "DTYPES"]

DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_BLOCK_BYTES = 256 << 10
_HEADER = 64          # bytes before each rank's data: its barrier counter and its count of
                      # non-finite chunks, alone in a line


class SharedBuffer:
    """A 1-D array of n elements per rank in one shared window (collective construction).

    data: this rank's array. allreduce_async(lo, hi) sums data[lo:hi] over the ranks in
    place and returns a Handle; reduce_scatter_async and allgather serve ZeRO's shards;
    fence() (or fence_async().wait()) before writing into a range reduced since.

    For a range [lo, hi):
    1. ready: barrier (every rank's range holds its final values);
    2. reduce: my chunk, chunk_of(lo, hi), summed over every rank's slice (mine first, then
       the next ranks' in a ring), block by block, into my own slice; my own values may
       come from elsewhere (`own`: an array nobody else reads need not be copied in); the
       sums are checked for Inf/NaN in the same pass;
    3. gather: barrier; copy every other rank's reduced chunk out of its slice, and add up
       the ranks' counts of non-finite chunks (`nonfinite`, the same on every rank).
    Memory traffic per rank: about n (p+1)/p + 2 n (p-1)/p bytes for n bytes, a third of
    the ring's. A third barrier (fence) separates the last gather from the next writes.
    Each reduction is on the flight recorder's record, so the watchdog reports a rank that
    stops submitting them.
    """

    @staticmethod
    def usable(comm, dtype) -> bool:
        """One node, several ranks, and a dtype summed without widening."""
        return shm.usable(as_communicator(comm)) and np.dtype(dtype) in DTYPES

    def __init__(self, n: int, dtype=np.float32, comm=None):
        c = as_communicator(comm)
        dtype = np.dtype(dtype)
        if not self.usable(c, dtype):
            raise ValueError(f"a SharedBuffer needs several ranks on one node and float32 or "
                             f"float64 data, got {c.size} rank(s) on {c.num_nodes} node(s), "
                             f"{dtype}; check SharedBuffer.usable first")
        self._owner = c                         # whose flight record lists the reductions
        self.comm = c.comm.Dup()                 # the worker's own channel
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        nbytes = _HEADER + int(n) * dtype.itemsize
        self.win = MPI.Win.Allocate_shared(nbytes, 1, comm=self.comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        mem = [np.frombuffer(self.win.Shared_query(r)[0], np.uint8)[:nbytes]
               for r in range(self.size)]
        self.slices = [m[_HEADER:].view(dtype) for m in mem]
        self._counters = [m[:16].view(np.int64) for m in mem]
        self._counters[self.rank][:2] = self._seq = 0
        self.nonfinite = 0
        self.comm.Barrier()
        self.data = self.slices[self.rank]
        self.data[...] = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpidist-window")
        self._block = max(1, _BLOCK_BYTES // dtype.itemsize)

    def _barrier(self) -> None:
        """Make my stores visible, wait for everyone, then see theirs: each rank raises
        its counter, then waits until every counter has reached its own."""
        self._seq += 1
        self.win.Sync()
        self._counters[self.rank][0] = self._seq
        for counter in self._counters:
            wait = Backoff()                   # a waiting rank costs its core little
            while counter[0] < self._seq:
                wait()
        self.win.Sync()

    def chunk_of(self, lo: int, hi: int) -> tuple[int, int]:
        """[a, b): the part of [lo, hi) whose sum this rank computes (its `own` may cover it)."""
        counts, displs = counts_displs(hi - lo, self.size)
        return lo + displs[self.rank], lo + displs[self.rank] + counts[self.rank]

    def _sum_into_mine(self, a: int, b: int, own=()) -> bool:
        """data[a:b] = my values + every other slice's [a, b), from the next rank on, block
        by block (in place where my values are my slice's); own: (start, array) pieces of
        my values to read instead of my slice. Returns whether every sum is finite."""
        s, r = self.slices, self.rank
        others = [s[(r + k) % self.size] for k in range(1, self.size)]
        pieces, x = [], a                       # (start, stop, my values there; None: data)
        for start, values in sorted(own, key=lambda piece: piece[0]):
            if x < start:
                pieces.append((x, start, None))
            pieces.append((start, start + values.shape[0], values))
            x = start + values.shape[0]
        if x < b:
            pieces.append((x, b, None))
        finite = True
        for start, stop, values in pieces:         # one call each: the GIL is free meanwhile
            finite &= sum_finite(self.data[start:stop], [o[start:stop] for o in others],
                                 values, self._block)
        return finite

    def _allreduce(self, lo: int, hi: int, own) -> None:
        counts, displs = counts_displs(hi - lo, self.size)
        a = lo + displs[self.rank]
        # 1. every rank's range is final
        self._barrier()
        # 2. my chunk summed in rank order over every slice, into my own slice
        if not self._sum_into_mine(a, a + counts[self.rank], own):
            self._counters[self.rank][1] += 1
        # 3. the other ranks' reduced chunks, and their count of non-finite ones
        self._barrier()
        self.nonfinite = sum(int(c[1]) for c in self._counters)
        for j in range(self.size):
            if j != self.rank:
                x = lo + displs[j]
                self.data[x:x + counts[j]] = self.slices[j][x:x + counts[j]]

    def _reduce_owned(self, lo: int, hi: int, mine: tuple[int, int]) -> None:
        self._barrier()
        self._sum_into_mine(max(lo, mine[0]), min(hi, mine[1]))

    def allreduce_async(self, lo: int, hi: int, own=()) -> Handle:
        """Start summing data[lo:hi] over the ranks (in submission order, collective: every
        rank submits the same ranges in the same order); wait() returns that view.

        own: (start, array) pieces, inside chunk_of(lo, hi) and apart, that hold my values
        there instead of data (which is not read there); held until the sum is done.
        After wait(), `nonfinite` counts every chunk so far whose sum held an Inf or NaN."""
        if not 0 <= lo <= hi <= self.data.shape[0]:
            raise ValueError(f"range [{lo}, {hi}) is outside the buffer's "
                             f"{self.data.shape[0]} elements")
        a, b = self.chunk_of(lo, hi)
        for start, values in own:
            if not (a <= start and start + values.shape[0] <= b and values.ndim == 1
                    and values.dtype == self.data.dtype):
                raise ValueError(f"own piece [{start}, {start + values.shape[0]}) is not a "
                                 f"1-D {self.data.dtype} array inside this rank's chunk "
                                 f"[{a}, {b}) of [{lo}, {hi})")
        entry = flight.begin(self._owner, ("shared_allreduce", ("lo", int(lo)), ("hi", int(hi))))
        fut = self._pool.submit(self._allreduce, int(lo), int(hi), tuple(own))
        return Handle(self.data[lo:hi], futures=[fut], entry=entry)

    def reduce_scatter_async(self, lo: int, hi: int, mine: tuple[int, int]) -> Handle:
        """Start summing over the ranks the part of data[lo:hi] this rank owns, mine =
        [a, b) (the ranks' owned ranges partition the buffer, as ZeRO's shards); steps 1
        and 2 of the allreduce. wait() returns data[a:b]."""
        if not 0 <= lo <= hi <= self.data.shape[0]:
            raise ValueError(f"range [{lo}, {hi}) is outside the buffer's "
                             f"{self.data.shape[0]} elements")
        entry = flight.begin(self._owner, ("shared_reduce_scatter", ("lo", int(lo)), ("hi", int(hi))))
        fut = self._pool.submit(self._reduce_owned, int(lo), int(hi), tuple(mine))
        return Handle(self.data[mine[0]:mine[1]], futures=[fut], entry=entry)

    def allgather(self, bounds) -> None:
        """Collective: copy every other rank's owned range [bounds[j], bounds[j+1]) out of
        its slice into mine (ZeRO's parameter allgather, nothing copied in)."""
        def run():
            self._barrier()
            for j in range(self.size):
                if j != self.rank:
                    self.data[bounds[j]:bounds[j + 1]] = self.slices[j][bounds[j]:bounds[j + 1]]
            self._barrier()
        self._run(("shared_allgather",), run)

    def fence(self) -> None:
        """Collective, after waiting for the reductions: no rank still reads my slice."""
        self._run(("shared_fence",), self._barrier)

    def fence_async(self) -> Handle:
        """Collective: the fence, queued behind the reductions submitted so far; once
        wait() returns, no rank still reads my slice."""
        entry = flight.begin(self._owner, ("shared_fence",))
        return Handle(futures=[self._pool.submit(self._barrier)], entry=entry)

    def _run(self, signature, fn) -> None:
        """fn on the worker, in order after the reductions, and wait; on the flight record."""
        entry = flight.begin(self._owner, signature)
        try:
            self._pool.submit(fn).result()
        finally:
            flight.end(entry)

    def free(self) -> None:
        """Collective: end the worker and free the window."""
        if self._pool is None:
            return
        self._pool.shutdown(wait=True)
        self._pool = None
        self.slices, self.data = [], None
        self.win.Unlock_all()
        self.win.Free()
        self.comm.Free()
