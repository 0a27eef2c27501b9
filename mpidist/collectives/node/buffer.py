"""A flat buffer that lives in a node's shared window, reduced where it lies.

The shm allreduce first copies each rank's input into the window; an array allocated in the
window to begin with (a gradient buffer that backward writes into directly) needs no such
copy. Each range is reduced by the rank that owns its chunk (reductions.reduce_chunk: rank
order, every rank ends with the same bits), on a worker thread of the buffer's own, so that
reductions overlap the caller's work; the window's barrier naps rather than spin on a core
the caller's compute still needs. Float32 and float64 only (half precision needs wider sums:
use the collectives, which widen). The phases: SharedBuffer.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mpidist.collectives import flight
from mpidist.collectives.handle import Handle
from mpidist.collectives.node.reductions import reduce_chunk
from mpidist.collectives.node.window import Window, usable
from mpidist.collectives.ops import OPS
from mpidist.comm import as_communicator
from mpidist.partition import counts_displs

__all__ = ["SharedBuffer", "DTYPES"]

DTYPES = (np.dtype(np.float32), np.dtype(np.float64))   # reduced without widening
_SUM = OPS["sum"]


class SharedBuffer:
    """A 1-D array of n elements per rank in one shared window (collective construction).

    data: this rank's array. allreduce_async(lo, hi) sums data[lo:hi] over the ranks in
    place and returns a Handle; reduce_scatter_async and allgather serve ZeRO's shards;
    fence() (or fence_async().wait()) before writing into a range reduced since.

    For a range [lo, hi):
    1. ready: the mismatch guard's barrier (every rank's range holds its final values, and
       every rank submitted the same call);
    2. reduce: my chunk, chunk_of(lo, hi), over every rank's slice in rank order, block by
       block, into my own slice; my own values may come from elsewhere (`own`: an array
       nobody else reads need not be copied in); the sums are tested for Inf/NaN;
    3. gather: barrier; copy every other rank's reduced chunk out of its slice, and add up
       the ranks' counts of non-finite chunks (`nonfinite`, the same on every rank).
    Memory traffic per rank: about n (p+1)/p + 2 n (p-1)/p bytes for n bytes, a third of
    the ring's. A third barrier (fence) separates the last gather from the next writes.
    Each call is checked like every collective (a rank that submits another call, or
    passes a bad range, makes every rank raise) and is on the flight record.
    """

    @staticmethod
    def usable(comm, dtype) -> bool:
        """One node, several ranks, and a dtype summed without widening."""
        return usable(as_communicator(comm)) and np.dtype(dtype) in DTYPES

    def __init__(self, n: int, dtype=np.float32, comm=None):
        c = as_communicator(comm)
        dtype = np.dtype(dtype)
        if not self.usable(c, dtype):
            raise ValueError(f"a SharedBuffer needs several ranks on one node and float32 or "
                             f"float64 data, got {c.size} rank(s) on {c.num_nodes} node(s), "
                             f"{dtype}; check SharedBuffer.usable first")
        self._owner = c                         # whose flight record lists the reductions
        self._window = Window(c, regions=1)     # on the worker's own channel
        self.rank, self.size = c.rank, c.size
        self.slices = self._window.slices(int(n), dtype)
        self.data = self.slices[self.rank]
        self.data[...] = 0
        self.nonfinite = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpidist-window")

    def chunk_of(self, lo: int, hi: int) -> tuple[int, int]:
        """[a, b): the part of [lo, hi) whose sum this rank computes (its `own` may cover it)."""
        counts, displs = counts_displs(hi - lo, self.size)
        return lo + displs[self.rank], lo + displs[self.rank] + counts[self.rank]

    def _sum_into_mine(self, a: int, b: int, own=()) -> bool:
        """data[a:b] = every slice's [a, b) summed in rank order (reduce_chunk); own:
        (start, array) pieces of my values to read instead of my slice. Returns whether
        every sum is finite."""
        pieces, x = [], a                       # (start, stop, my values there; None: data)
        for start, values in sorted(own, key=lambda piece: piece[0]):
            if x < start:
                pieces.append((x, start, None))
            pieces.append((start, start + values.shape[0], values))
            x = start + values.shape[0]
        if x < b:
            pieces.append((x, b, None))
        finite, block = True, self._window.block(self.data.dtype)
        for start, stop, values in pieces:
            terms = [s[start:stop] for s in self.slices]
            if values is not None:
                terms[self.rank] = values
            finite &= reduce_chunk(terms, self.data[start:stop], _SUM, block, finite=True)
        return finite

    def _allreduce(self, signature, lo: int, hi: int, own) -> None:
        a, b = self.chunk_of(lo, hi)
        # 1. every rank's range is final, and every rank made this call
        self._window.agree(signature)
        # 2. my chunk summed in rank order over every slice, into my own slice
        if not self._sum_into_mine(a, b, own):
            self._window.flag()
        # 3. the other ranks' reduced chunks, and their count of non-finite ones
        self._window.barrier()
        self.nonfinite = self._window.flags()
        counts, displs = counts_displs(hi - lo, self.size)
        for j in range(self.size):
            if j != self.rank:
                x = lo + displs[j]
                self.data[x:x + counts[j]] = self.slices[j][x:x + counts[j]]

    def _reduce_owned(self, signature, lo: int, hi: int, mine: tuple[int, int]) -> None:
        self._window.agree(signature)
        self._sum_into_mine(max(lo, mine[0]), min(hi, mine[1]))

    def allreduce_async(self, lo: int, hi: int, own=()) -> Handle:
        """Start summing data[lo:hi] over the ranks (in submission order, collective: every
        rank submits the same ranges in the same order); wait() returns that view.

        own: (start, array) pieces, inside chunk_of(lo, hi) and apart, that hold my values
        there instead of data (which is not read there); held until the sum is done.
        After wait(), `nonfinite` counts every chunk so far whose sum held an Inf or NaN."""
        error = self._range_error(lo, hi)
        if error is None:
            a, b = self.chunk_of(lo, hi)
            for start, values in own:
                if not (a <= start and start + values.shape[0] <= b and values.ndim == 1
                        and values.dtype == self.data.dtype):
                    error = ValueError(f"own piece [{start}, {start + values.shape[0]}) is "
                                       f"not a 1-D {self.data.dtype} array inside this rank's "
                                       f"chunk [{a}, {b}) of [{lo}, {hi})")
                    break
        signature = ("shared_allreduce", ("lo", int(lo)), ("hi", int(hi)))
        entry, fut = self._submit(signature, error, self._allreduce, int(lo), int(hi),
                                  tuple(own))
        return Handle(self.data[lo:hi], futures=[fut], entry=entry)

    def reduce_scatter_async(self, lo: int, hi: int, mine: tuple[int, int]) -> Handle:
        """Start summing over the ranks the part of data[lo:hi] this rank owns, mine =
        [a, b) (the ranks' owned ranges partition the buffer, as ZeRO's shards); steps 1
        and 2 of the allreduce. wait() returns data[a:b]."""
        signature = ("shared_reduce_scatter", ("lo", int(lo)), ("hi", int(hi)))
        entry, fut = self._submit(signature, self._range_error(lo, hi), self._reduce_owned,
                                  int(lo), int(hi), tuple(mine))
        return Handle(self.data[mine[0]:mine[1]], futures=[fut], entry=entry)

    def allgather(self, bounds) -> None:
        """Collective: copy every other rank's owned range [bounds[j], bounds[j+1]) out of
        its slice into mine (ZeRO's parameter allgather, nothing copied in)."""
        def run(signature):
            self._window.agree(signature)
            for j in range(self.size):
                if j != self.rank:
                    self.data[bounds[j]:bounds[j + 1]] = self.slices[j][bounds[j]:bounds[j + 1]]
            self._window.barrier()
        self._wait(*self._submit(("shared_allgather",), None, run))

    def fence(self) -> None:
        """Collective, after waiting for the reductions: no rank still reads my slice."""
        self._wait(*self._submit(("shared_fence",), None, self._window.agree))

    def fence_async(self) -> Handle:
        """Collective: the fence, queued behind the reductions submitted so far; once
        wait() returns, no rank still reads my slice."""
        entry, fut = self._submit(("shared_fence",), None, self._window.agree)
        return Handle(futures=[fut], entry=entry)

    def _range_error(self, lo: int, hi: int):
        if 0 <= lo <= hi <= self.data.shape[0]:
            return None
        return ValueError(f"range [{lo}, {hi}) is outside the buffer's {self.data.shape[0]} "
                          f"elements")

    def _submit(self, signature, error, fn, *args):
        """Queue fn(signature, *args) on the worker, behind the calls submitted so far, on
        the flight record: (entry, future). An argument error is raised here, after
        queueing its vote, which makes every other rank's call raise too."""
        if error is not None:
            self._pool.submit(self._window.agree, signature, error)
            raise error
        entry = flight.begin(self._owner, signature)
        return entry, self._pool.submit(fn, signature, *args)

    @staticmethod
    def _wait(entry, fut) -> None:
        try:
            fut.result()
        finally:
            flight.end(entry)

    def free(self) -> None:
        """Collective: end the worker and free the window."""
        if self._pool is None:
            return
        self._pool.shutdown(wait=True)
        self._pool = None
        self.slices, self.data = [], None
        self._window.free()
