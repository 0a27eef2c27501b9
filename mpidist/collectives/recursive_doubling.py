"""Recursive-doubling allreduce: log2 p rounds; in round k each rank swaps its whole
buffer with the rank 2^k away and reduces. The fewest rounds of any algorithm (the
latency champion for small messages, MPICH's and Open MPI's choice there), but every
round moves the whole buffer.

Non-powers of two: with p' the largest power of two <= p and rem = p - p', the first 2 rem
ranks pair up (even -> odd) and the odd rank reduces both; the p' remaining ranks double;
the odd ranks finally send the result back to their even partners.
Same bits everywhere: each pair reduces with the lower rank's operand first.

Cost: (ceil(log2 p) + 2 [p not a power of 2]) (alpha + n beta) + ceil(log2 p) n gamma.
"""
from __future__ import annotations

from mpidist.collectives.ops import Op, reduce_into
from mpidist.collectives.workspace import same_view, scratch

__all__ = ["allreduce", "fold", "unfold"]

_TAG = 501


def fold(rank: int, size: int) -> tuple[int, int, int]:
    """(p2, rem, newrank): the power of two that takes part, the extra ranks, and this
    rank's index among the p2 participants (-1 for an even rank folded into rank+1)."""
    p2 = 1 << (size.bit_length() - 1)
    rem = size - p2
    if rank < 2 * rem:
        return p2, rem, rank // 2 if rank % 2 else -1
    return p2, rem, rank - rem


def real_rank(newrank: int, rem: int) -> int:
    """The rank of participant `newrank`."""
    return 2 * newrank + 1 if newrank < rem else newrank + rem


def unfold(mpi, buf, rank: int, rem: int, tag: int) -> None:
    """The last phase of a folded algorithm: each odd rank among the first 2 rem sends its
    result in buf back to the even rank folded into it."""
    if rank < 2 * rem:
        if rank % 2 == 0:
            mpi.Recv(buf, rank + 1, tag)
        else:
            mpi.Send(buf, rank - 1, tag)


def allreduce(comm, sendbuf, recvbuf, op: Op):
    """Recursive-doubling allreduce (recvbuf may be sendbuf)."""
    mpi, p, r = comm.comm, comm.size, comm.rank
    n = len(sendbuf)
    if not same_view(recvbuf, sendbuf):
        recvbuf[...] = sendbuf
    p2, rem, newrank = fold(r, p)
    tmp = scratch(comm, "recursive_doubling.recv", n, sendbuf.dtype, like=sendbuf)
    # 1. fold the extra ranks in: even rank r hands its data to r + 1
    if r < 2 * rem:
        if newrank < 0:
            mpi.Send(recvbuf, r + 1, _TAG)
        else:
            mpi.Recv(tmp, r - 1, _TAG)
            reduce_into(op, tmp, recvbuf, recvbuf)        # lower rank's operand first
    # 2. recursive doubling among the p2 participants
    if newrank >= 0:
        mask = 1
        while mask < p2:
            partner = real_rank(newrank ^ mask, rem)
            mpi.Sendrecv(recvbuf, partner, _TAG, tmp, partner, _TAG)
            if partner < r:
                reduce_into(op, tmp, recvbuf, recvbuf)
            else:
                reduce_into(op, recvbuf, tmp, recvbuf)
            mask <<= 1
        op.finalize(recvbuf, p)
    unfold(mpi, recvbuf, r, rem, _TAG)        # 3. the folded ranks get the result
    return recvbuf
