"""The ring that carries compressed data: messages of any length between ring neighbours,
with the bytes this rank sends counted where they leave.

`allreduce` follows the step schedule of the uncompressed ring (collectives.ring.steps),
its hops carrying chunks through a codec (mpidist.compress.codecs): a reduce-scatter of
encoded partial sums, then an allgather of the encoded sums, so every rank ends with the
same numbers. `allgather` passes every rank's payload round the ring.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpidist.collectives.ring import steps
from mpidist.partition import counts_displs

__all__ = ["Ring", "ring_allreduce_bytes"]

_TAG = 0x5C0


def ring_allreduce_bytes(n: int, size: int, rank: int, itemsize: int = 4) -> int:
    """Bytes rank sends in an uncompressed ring allreduce of n elements: every chunk but
    one in the reduce-scatter and every chunk but one in the allgather (~2(p-1)/p * n)."""
    if size == 1:
        return 0
    counts, _ = counts_displs(n, size)
    return itemsize * (2 * n - counts[(rank + 1) % size] - counts[(rank + 2) % size])


class Ring:
    """Ring exchanges over a Communicator; `sent`: the bytes this rank has sent."""

    def __init__(self, comm):
        self.comm = comm.comm
        self.rank, self.size = comm.rank, comm.size
        self.right, self.left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.sent = 0

    def shift(self, buf: np.ndarray) -> np.ndarray:
        """Send buf to the right neighbour; return what the left one sent (any length)."""
        req = self.comm.Isend([buf, MPI.BYTE], dest=self.right, tag=_TAG)
        status = MPI.Status()
        self.comm.Probe(source=self.left, tag=_TAG, status=status)
        out = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        self.comm.Recv([out, MPI.BYTE], source=self.left, tag=_TAG)
        req.Wait()
        self.sent += buf.nbytes
        return out

    def allgather(self, mine: np.ndarray) -> list:
        """Every rank's uint8 message, in rank order: the allgather steps of the ring,
        each forwarding the message received in the step before."""
        blocks = [None] * self.size
        blocks[self.rank] = mine
        for send, recv in steps(self.rank, self.size)[self.size - 1:]:
            blocks[recv] = self.shift(blocks[send])
        return blocks

    def allreduce(self, x: np.ndarray, codec) -> np.ndarray:
        """In-place sum of float32 x over ranks. Hops carry codec.encode(lo, x[lo:hi])
        (lo: where the chunk starts); codec.add(msg, out) adds a message's values into
        out, codec.set(msg, out) overwrites out with them."""
        p = self.size
        counts, displs = counts_displs(x.shape[0], p)

        def part(c):
            return x[displs[c]:displs[c] + counts[c]]

        own = (self.rank + 1) % p           # the chunk this rank completes (as it always has)
        plan = steps(own, p)
        # 1. reduce-scatter: send my partial sum of one chunk, add the one received into mine
        for send, recv in plan[:p - 1]:
            codec.add(self.shift(codec.encode(displs[send], part(send))), part(recv))
        # my chunk now holds the full sum; keep its encoded form, so every rank ends with
        # the same numbers
        msg = codec.encode(displs[own], part(own))
        codec.set(msg, part(own))
        # 2. allgather the encoded sums: forward the message received in the step before
        for _, recv in plan[p - 1:]:
            msg = self.shift(msg)
            codec.set(msg, part(recv))
        return x
