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

import hashlib
import time

import numpy as np
from mpi4py import MPI

from mpidist.collectives import flight, guard
from mpidist.errors import MismatchError
from mpidist.partition import counts_displs

__all__ = ["Node", "DTYPES"]

DTYPES = (np.dtype(np.float32), np.dtype(np.float64))   # reduced without widening
_LINE = 64            # bytes of each rank's header: counter, two digests (by parity)
_ERROR = -1           # the digest of a rank with an argument error (digests are >= 0)
_BLOCK_BYTES = 256 << 10
_SPINS = 64           # polls before the waiting thread starts sleeping between polls
_NAP_MAX = 200e-6     # the longest sleep between polls (seconds)


def _digest(signature) -> int:
    raw = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 2


class Node:
    """The window of one process group whose ranks share a node (collective construction;
    used by one thread at a time, the group's worker).

    check(signature, error) is a barrier: each rank writes the digest of its call's
    signature (a rank with an argument error writes one no signature takes), raises its
    counter, waits for every counter, then compares the digests; when they differ every
    rank sees it and guard.check exchanges the full signatures to raise, naming who differs.

    allreduce(x, y, op, signature) of n elements:
    1. publish: my input into my slice of the window (the region of this call's parity);
       barrier with the digest (the guard);
    2. reduce: my chunk, chunk(n, rank, size), over every rank's slice in rank order, block
       by block, into my own slice and into y;
    3. gather: barrier; every other rank's reduced chunk out of its slice into y.
    Calls alternate between two regions of the window: a rank writes a region again only
    after the barrier of the call in between, which every rank passes after its step 3 of
    the call before; so two barriers per call.
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
        self._digests: dict = {}
        self._mpi.Barrier()

    # ------------------------------------------------------------------ the guard
    def _barrier(self, digest: int | None = None) -> bool:
        """Wait for every rank; with a digest, whether every rank wrote the same one."""
        self._seq += 1
        mine = self._lines[self.rank]
        slot = 1 + self._seq % 2                         # a rank two barriers ahead is
        if digest is not None:                           # past my reading of this one
            mine[slot] = digest
        self._head.Sync()
        mine[0] = self._seq
        for line in self._lines:
            polls, nap = 0, 20e-6
            while line[0] < self._seq:
                polls += 1
                if polls > _SPINS:                       # back off: leave the core
                    time.sleep(nap)
                    nap = min(2 * nap, _NAP_MAX)
        self._head.Sync()
        return digest is None or all(line[slot] == digest for line in self._lines)

    def _vote(self, signature, error) -> int:
        if error is not None or signature is None:
            return _ERROR
        d = self._digests.get(signature)
        if d is None:
            if len(self._digests) > 4096:
                self._digests.clear()
            d = self._digests[signature] = _digest(signature)
        return d

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

    def allreduce(self, x: np.ndarray, y: np.ndarray, op, signature, scale=None) -> None:
        """y = x (times scale, if given) reduced with op (an mpidist Op) over the ranks;
        y may be x. Float32 or float64; collective, guarded by `signature`."""
        if x.nbytes > self._capacity:
            flight.end(self.check(signature))
        entry = flight.begin(self.comm, signature)
        try:
            part = self._regions(x.size, x.dtype)
            mine = part[self.rank]
            # 1. publish my input; every rank's is there and the signatures agree
            if scale is None:
                mine[...] = x
            else:
                np.multiply(x, scale, out=mine)
            if not self._barrier(self._vote(signature, None)):
                self._disagree(signature, None)
            # 2. my chunk over every slice, in rank order, into my slice and y
            counts, displs = counts_displs(x.size, self.size)
            lo = displs[self.rank]
            self._reduce_chunk(part, lo, lo + counts[self.rank], op, y)
            # 3. the others' reduced chunks
            self._barrier()
            for j in range(self.size):
                if j != self.rank:
                    y[displs[j]:displs[j] + counts[j]] = part[j][displs[j]:displs[j] + counts[j]]
        finally:
            flight.end(entry)

    def _reduce_chunk(self, part, lo: int, hi: int, op, y) -> None:
        """part[rank][lo:hi] = op over part[0..size-1][lo:hi] (finalized), also into y, one
        cache-sized block at a time."""
        mine, p = part[self.rank], self.size
        block = max(1, _BLOCK_BYTES // mine.dtype.itemsize)
        acc = np.empty(min(block, max(hi - lo, 1)), mine.dtype) if p > 2 else None
        for a in range(lo, hi, block):
            b = min(a + block, hi)
            out = mine[a:b]
            t = acc[:b - a] if p > 2 else out
            op.ufunc(part[0][a:b], part[1][a:b], out=t)
            for k in range(2, p):
                op.ufunc(t, part[k][a:b], out=t if k < p - 1 else out)
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
