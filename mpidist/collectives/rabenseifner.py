"""Rabenseifner's allreduce: a recursive-halving reduce-scatter then a recursive-doubling
allgather. Bandwidth-optimal like the ring (each rank moves 2 (p-1)/p n) with only
2 log2 p rounds, so it is the ring's rival at medium sizes (MPICH and Open MPI use it).

Non-powers of two are folded as in recursive doubling (extra even ranks hand their data to
their odd neighbour first and get the result back last). Each block is reduced by one
rank only and then distributed, so every rank ends with the same bits.

Cost: 2 log2 p' alpha + 2 (p'-1)/p' n beta + (p'-1)/p' n gamma, plus 2 (alpha + n beta) +
n gamma when p is not a power of two (p' = largest power of two <= p).
"""
from __future__ import annotations

from mpidist.collectives.ops import Op, reduce_into
from mpidist.collectives.recursive_doubling import fold, real_rank, unfold
from mpidist.collectives.workspace import same_view, scratch
from mpidist.partition import counts_displs

__all__ = ["allreduce"]

_TAG = 601


def allreduce(comm, sendbuf, recvbuf, op: Op):
    """Recursive halving + recursive doubling (recvbuf may be sendbuf)."""
    mpi, p, r = comm.comm, comm.size, comm.rank
    n = len(sendbuf)
    p2, rem, newrank = fold(r, p)
    tmp = scratch(comm, "rabenseifner.half", (n + 1) // 2 + 1, sendbuf.dtype, like=sendbuf)
    src = sendbuf                     # my data until the first reduction lands in recvbuf
    # 1. fold the extra ranks in
    if r < 2 * rem:
        if newrank < 0:
            mpi.Send(sendbuf, r + 1, _TAG)
        else:
            full = scratch(comm, "rabenseifner.full", n, sendbuf.dtype, like=sendbuf)
            mpi.Recv(full, r - 1, _TAG)
            reduce_into(op, full, sendbuf, recvbuf)
            src = recvbuf
    if newrank >= 0:
        counts, displs = counts_displs(n, p2)
        bounds = displs + [n]
        lo, hi = 0, p2                # the blocks I am responsible for
        # 2. recursive halving: keep half of my blocks, send the other half, reduce
        mask = p2 >> 1
        while mask:
            partner = real_rank(newrank ^ mask, rem)
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if newrank & mask == 0 else ((mid, hi), (lo, mid))
            k0, k1 = bounds[keep[0]], bounds[keep[1]]
            g0, g1 = bounds[give[0]], bounds[give[1]]
            got = tmp[:k1 - k0]
            mpi.Sendrecv(src[g0:g1], partner, _TAG, got, partner, _TAG)
            if partner < r:
                reduce_into(op, got, src[k0:k1], recvbuf[k0:k1])
            else:
                reduce_into(op, src[k0:k1], got, recvbuf[k0:k1])
            src = recvbuf
            lo, hi = keep
            mask >>= 1
        if p2 == 1 and not same_view(recvbuf, src):
            recvbuf[...] = src
        op.finalize(recvbuf[bounds[lo]:bounds[hi]], p)
        # 3. recursive doubling allgather: swap my blocks for my partner's
        mask = 1
        while mask < p2:
            partner = real_rank(newrank ^ mask, rem)
            size_blocks = hi - lo
            plo = lo + size_blocks if newrank & mask == 0 else lo - size_blocks
            phi = plo + size_blocks
            mpi.Sendrecv(recvbuf[bounds[lo]:bounds[hi]], partner, _TAG,
                         recvbuf[bounds[plo]:bounds[phi]], partner, _TAG)
            lo, hi = min(lo, plo), max(hi, phi)
            mask <<= 1
    unfold(mpi, recvbuf, r, rem, _TAG)        # 4. the folded ranks get the result
    return recvbuf
