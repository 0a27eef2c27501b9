"""Sharded exchanges over an arbitrary global range [lo, hi) of the flat layout.

ZeRO's shards are the chunk() partition of the WHOLE flat buffer, but stage 2 reduces a
gradient bucket and stage 3 gathers one layer's parameters: a sub-range whose pieces belong
to a varying set of ranks. mpidist.collectives partitions the buffer it is given, which
would not line up with the shards, so these two v-collectives are built on MPI's
Ialltoallv / Iallgatherv, sending raw bytes (fp16/bf16 travel at two bytes). The owner of a
piece sums the `size` contributions in rank order in an fp32 (or wider) accumulator and
rounds once: the result does not depend on arrival order. Both return a Handle at once, so
the exchange overlaps the caller's compute; wait() completes it.
"""
from __future__ import annotations

from mpi4py import MPI

from mpidist.collectives.handle import Handle
from mpidist.collectives.ops import accumulator_dtype, narrow, widen
from mpidist.kernels.backend import byte_view, get_array_module
from mpidist import partition

__all__ = ["ShardMap", "reduce_scatter_start", "allgather_start"]


class ShardMap:
    """Where each rank's shard lies: the chunk() partition of n elements over the comm."""

    def __init__(self, comm, n: int):
        self.comm, self.n = comm, int(n)
        self.counts, self.displs = partition.counts_displs(self.n, comm.size)
        self.offset, self.count = self.displs[comm.rank], self.counts[comm.rank]

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(start relative to lo, length) of [lo, hi) ∩ shard r, for every rank r."""
        return partition.pieces(lo, hi, self.n, self.comm.size)

    def mine(self, lo: int, hi: int) -> tuple[int, int]:
        """(global start, length) of [lo, hi) ∩ my shard (length 0 when disjoint)."""
        a, b = max(lo, self.offset), min(hi, self.offset + self.count)
        return a, max(0, b - a)


def reduce_scatter_start(comm, shards: ShardMap, buf, lo: int, *, out=None) -> Handle:
    """Start summing buf (the global range [lo, lo+len(buf)) on every rank) onto its owners.

    wait() returns my piece (the range ∩ my shard) of the sum over ranks, in buf's dtype,
    or, with `out`, adds it into out (rounding once) and returns out. My own piece is not
    sent: it is read from buf when the pieces are summed. Collective over comm: every rank
    passes the same [lo, hi).
    """
    hi = lo + int(buf.shape[0])
    xp = get_array_module(buf)
    pieces = shards.pieces(lo, hi)
    start, mine = shards.mine(lo, hi)
    me, item = comm.rank, buf.dtype.itemsize
    others = [r for r in range(comm.size) if r != me]
    recv = xp.empty((len(others), mine), dtype=buf.dtype)
    src = buf if buf.flags.c_contiguous else xp.ascontiguousarray(buf)
    send_mpi, recv_mpi = comm.to_mpi(src), comm.to_mpi(recv)
    scounts = [0 if r == me else c * item for r, (_, c) in enumerate(pieces)]
    sdispls = [s * item for s, _ in pieces]
    slot = {r: i for i, r in enumerate(others)}
    rcounts = [0 if r == me else mine * item for r in range(comm.size)]
    rdispls = [0 if r == me else slot[r] * mine * item for r in range(comm.size)]
    request = comm.comm.Ialltoallv([byte_view(send_mpi), (scounts, sdispls), MPI.BYTE],
                                   [byte_view(recv_mpi), (rcounts, rdispls), MPI.BYTE])

    def finish():
        comm.from_mpi(recv_mpi, recv)
        local = buf[start - lo:start - lo + mine]
        wide_dtype = accumulator_dtype(buf.dtype)
        half = wide_dtype != buf.dtype          # widened by the bit-level cast kernels
        acc, wide = None, xp.empty(mine, wide_dtype) if half else None
        for r in range(comm.size):              # rank order: independent of arrival order
            piece = local if r == me else recv[slot[r]]
            if half:
                widen(piece, wide)
                piece = wide
            if acc is None:
                acc = piece.copy()
            else:
                acc += piece
        if out is not None:
            out[...] += acc
            return out
        if not half:
            return acc
        result = xp.empty(mine, buf.dtype)
        narrow(acc, result)
        return result

    return Handle(requests=[request], finish=finish, buffers=(send_mpi, recv_mpi))


def allgather_start(comm, shards: ShardMap, shard, lo: int, hi: int, *, out=None) -> Handle:
    """Start gathering the global range [lo, hi) from the shards that hold it.

    shard: my whole shard (1-D, shards.count elements). wait() returns the range as one
    1-D array (`out` when given). Collective over comm: every rank passes the same [lo, hi).
    """
    xp = get_array_module(shard)
    if out is None:
        out = xp.empty(hi - lo, dtype=shard.dtype)
    pieces = shards.pieces(lo, hi)
    start, mine = shards.mine(lo, hi)
    item = shard.dtype.itemsize
    local = shard[start - shards.offset:start - shards.offset + mine] if mine else shard[:0]
    send_mpi = comm.to_mpi(xp.ascontiguousarray(local))
    recv_mpi = comm.to_mpi(out)
    counts = [c * item for _, c in pieces]
    displs = [s * item for s, _ in pieces]
    request = comm.comm.Iallgatherv([byte_view(send_mpi), mine * item, MPI.BYTE],
                                    [byte_view(recv_mpi), (counts, displs), MPI.BYTE])

    def finish():
        comm.from_mpi(recv_mpi, out)
        return out

    return Handle(requests=[request], finish=finish, buffers=(recv_mpi,))
