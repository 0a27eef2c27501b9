"""The backend's path within one node: a shared window whose counters are the mismatch guard
of every collective of a process group, and an allreduce of float buffers (DDP's buckets)
reduced in that window, with no MPI call on the way.

Why not MPI's barrier and the shm algorithm: an MPI rank waiting for the others polls its
core; DDP's first bucket is ready while the other ranks are still in backward, and on a node
with more ranks than cores the poller takes that core from them. Here a waiting rank polls a
counter a few times, then sleeps between polls, as SharedBuffer does. Every rank gets the
bits of mpidist's shm allreduce. The protocol: Node.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from mpidist.backoff import Backoff
from mpidist.collectives import flight, guard
from mpidist.errors import MismatchError
from mpidist.partition import counts_displs

__all__ = ["Node", "DTYPES"]

DTYPES = (np.dtype(np.float32), np.dtype(np.float64))   # reduced without widening
_LINE = 64            # bytes of each rank's header: counter, two digests (by parity)
_ERROR = -1           # the digest of a rank with an argument error (digests are >= 0)
_BLOCK_BYTES = 256 << 10

class _Call(NamedTuple):
    """An allreduce between begin and finish."""
    x: np.ndarray
    y: np.ndarray
    own: np.ndarray                 # my input as reduced: x, or my slice when scaled
    op: object
    signature: tuple
    entry: list                     # the flight recorder's
    part: list
    counts: np.ndarray
    displs: np.ndarray
    seq: int                        # the first barrier's
    slot: int
    digest: int


class Node:
    """The window of one process group whose ranks share a node (collective construction;
    used by one thread at a time: the caller's or the group's worker).

    check(signature, error) is a barrier: each rank writes the digest of its call's
    signature (a rank with an argument error writes one no signature takes), raises its
    counter, waits for every counter, then compares the digests; when they differ every
    rank sees it and guard.check exchanges the full signatures to raise, naming who differs.

    allreduce(x, y, op, signature) of n elements:
    1. publish: my input into my slice of the window (the region of this call's parity),
       but for my own chunk, chunk(n, rank, size), which only I read; barrier with the
       digest (the guard);
    2. reduce: my chunk over every rank's input in rank order (mine from x, the others'
       from their slices), block by block, into my own slice and into y;
    3. gather: barrier; every other rank's reduced chunk out of its slice into y, each as
       soon as that rank has arrived (so a rank copies while the others still reduce).
    Calls alternate between two regions of the window: a rank writes a region again only
    after the first barrier of the call in between, which every rank passes after its step 3
    of the call before; so two barriers per call. begin (step 1) and finish (the rest) split
    the call where the caller would wait for a rank that has not called yet.
    """

    def __init__(self, comm):
        self.comm = comm                                 # the mpidist Communicator
        self._mpi = comm.comm.Dup()
        self.rank, self.size = comm.rank, comm.size
        self._head = MPI.Win.Allocate_shared(_LINE, 1, comm=self._mpi)
        self._head.Lock_all(MPI.MODE_NOCHECK)
        self._lines = [np.frombuffer(self._head.Shared_query(r)[0], np.int64)[:_LINE // 8]
                       for r in range(self.size)]
        self._lines[self.rank][:] = 0
        self._seq = 0
        self._data, self._slices, self._capacity, self._parity = None, [], 0, 0
        self._mpi.Barrier()

    # ------------------------------------------------------------------ the guard
    def _barrier(self, digest: int | None = None) -> bool:
        """Wait for every rank; with a digest, whether every rank wrote the same one."""
        slot = self._arrive(digest)
        self._await(self._seq)
        return self._agreed(slot, digest)

    def _arrive(self, digest: int | None) -> int:
        """My side of a barrier: the digest in this barrier's slot, then my counter raised.
        Returns the slot."""
        self._seq += 1
        mine = self._lines[self.rank]
        slot = 1 + self._seq % 2                         # a rank two barriers ahead is
        if digest is not None:                           # past my reading of this one
            mine[slot] = digest
        self._head.Sync()
        mine[0] = self._seq
        return slot

    def _await(self, seq: int, patience: float | None = None) -> bool:
        """Whether every rank has arrived at barrier seq, waiting at most `patience` seconds
        (None: until they have)."""
        deadline = None if patience is None else time.perf_counter() + patience
        for line in self._lines:
            wait = Backoff(deadline)
            while line[0] < seq:
                if not wait():
                    return False
        return True

    def _arrivals(self, seq: int):
        """The other ranks, each as it arrives at barrier seq (waiting as _await does), so
        the caller works on one while the others are still on their way."""
        pending = [j for j in range(self.size) if j != self.rank]
        wait = Backoff()
        while pending:
            ready = [j for j in pending if self._lines[j][0] >= seq]
            if ready:
                self._head.Sync()                        # their writes before the counter
                for j in ready:
                    pending.remove(j)
                    yield j
                continue
            wait()

    def _agreed(self, slot: int, digest: int | None) -> bool:
        """After every rank arrived: whether they all wrote my digest in the slot."""
        self._head.Sync()
        return digest is None or all(line[slot] == digest for line in self._lines)

    def _vote(self, signature, error) -> int:
        if error is not None or signature is None:
            return _ERROR
        return guard.digest(signature)

    def check(self, signature, error: BaseException | None = None) -> list:
        """The mismatch guard over the window: raise on every rank when any rank has an
        error or a different signature. Returns the flight-recorder entry to end."""
        entry = flight.begin(self.comm, signature)
        try:
            if not self._barrier(self._vote(signature, error)) or error is not None:
                self._disagree(signature, error)
        except BaseException:
            flight.end(entry)
            raise
        return entry

    def _disagree(self, signature, error) -> None:
        """Every rank saw the digests differ: raise on every rank, naming who differs
        (guard.check's exchange; with the guard off, a plain error)."""
        flight.end(guard.check(self.comm, signature, error))
        if error is not None:
            raise error
        raise MismatchError("ranks disagree on the collective call (the guard is off: set "
                            "MPIDIST_GUARD=on to see which)")

    # ------------------------------------------------------------------ the allreduce
    def _regions(self, n: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's slice of this call's region, n elements of dtype (collective when
        the window grows: the guard has made every rank agree on n and dtype)."""
        nbytes = n * dtype.itemsize
        if nbytes > self._capacity:     # (after a check: every rank grows it, or none)
            if self._data is not None:
                self._data.Unlock_all()
                self._data.Free()
            self._capacity = max(nbytes, 2 * self._capacity)
            self._data = MPI.Win.Allocate_shared(2 * self._capacity, 1, comm=self._mpi)
            self._data.Lock_all(MPI.MODE_NOCHECK)
            self._slices = [np.frombuffer(self._data.Shared_query(r)[0], np.uint8)
                            [:2 * self._capacity] for r in range(self.size)]
        self._parity ^= 1
        at = self._parity * self._capacity
        return [s[at:at + nbytes].view(dtype) for s in self._slices]

    def fits(self, x: np.ndarray) -> bool:
        """Whether x's allreduce needs no growth of the window (so no extra barrier)."""
        return x.nbytes <= self._capacity

    def allreduce(self, x: np.ndarray, y: np.ndarray, op, signature, scale=None) -> None:
        """y = x (times scale, if given) reduced with op (an mpidist Op) over the ranks;
        y may be x. Float32 or float64; collective, guarded by `signature`."""
        if not self.fits(x):
            flight.end(self.check(signature))
        self.finish(self.begin(x, y, op, signature, scale))

    def begin(self, x: np.ndarray, y: np.ndarray, op, signature, scale=None) -> _Call:
        """Step 1 of allreduce, without waiting: publish x and arrive at the first barrier.
        The window must fit x (fits). finish(call) does the rest; ready(call) says whether
        every rank has arrived, so finish would not wait for a rank that has not called."""
        entry = flight.begin(self.comm, signature)
        try:
            part = self._regions(x.size, x.dtype)
            counts, displs = counts_displs(x.size, self.size)
            lo, hi = displs[self.rank], displs[self.rank] + counts[self.rank]
            mine = part[self.rank]
            # 1. publish my input (my own chunk stays in x: only I reduce it)
            if scale is None:
                own = x
                mine[:lo] = x[:lo]
                mine[hi:] = x[hi:]
            else:
                own = mine
                np.multiply(x, scale, out=mine)
            digest = self._vote(signature, None)
            slot = self._arrive(digest)
        except BaseException:
            flight.end(entry)
            raise
        return _Call(x, y, own, op, signature, entry, part, counts, displs, self._seq, slot,
                     digest)

    def ready(self, call: _Call, patience: float) -> bool:
        """Whether every rank has called (arrived at call's first barrier), waiting at most
        `patience` seconds."""
        return self._await(call.seq, patience)

    def finish(self, call: _Call) -> None:
        """Steps 2 and 3 of allreduce: wait for every rank, reduce my chunk, gather."""
        try:
            self._await(call.seq)
            # every rank's input is there; the signatures agree
            if not self._agreed(call.slot, call.digest):
                self._disagree(call.signature, None)
            # 2. my chunk over every rank's input, in rank order, into my slice and y
            counts, displs, part, y = call.counts, call.displs, call.part, call.y
            lo = displs[self.rank]
            self._reduce_chunk(part, call.own, lo, lo + counts[self.rank], call.op, y)
            # 3. the others' reduced chunks, each once its rank has reduced it
            self._arrive(None)
            for j in self._arrivals(self._seq):
                y[displs[j]:displs[j] + counts[j]] = part[j][displs[j]:displs[j] + counts[j]]
        finally:
            flight.end(call.entry)

    def _reduce_chunk(self, part, own, lo: int, hi: int, op, y) -> None:
        """part[rank][lo:hi] = op over every rank's [lo:hi] in rank order (finalized; my own
        input is `own`, the others' are their slices), also into y, one cache-sized block at a
        time."""
        mine, p = part[self.rank], self.size
        src = [own if k == self.rank else part[k] for k in range(p)]
        block = max(1, _BLOCK_BYTES // mine.dtype.itemsize)
        acc = np.empty(min(block, max(hi - lo, 1)), mine.dtype) if p > 2 else None
        for a in range(lo, hi, block):
            b = min(a + block, hi)
            out = mine[a:b]
            t = acc[:b - a] if p > 2 else out
            op.ufunc(src[0][a:b], src[1][a:b], out=t)
            for k in range(2, p):
                op.ufunc(t, src[k][a:b], out=t if k < p - 1 else out)
            op.finalize(out, p)
            y[a:b] = out

    def free(self) -> None:
        """Collective: free the windows."""
        if self._mpi is None:
            return
        for win in (self._data, self._head):
            if win is not None:
                win.Unlock_all()
                win.Free()
        self._data, self._slices, self._lines = None, [], []
        self._mpi.Free()
        self._mpi = None
