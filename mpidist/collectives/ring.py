"""Ring allreduce: a reduce-scatter then an allgather around the ring r -> r+1.

Each of the 2(p-1) steps moves one chunk (chunk() partition of the buffer) to the right
neighbour. Chunks are cut into segments sent and received with nonblocking calls, and a
segment is forwarded as soon as it has been reduced, so sending, receiving and reducing
overlap along the ring. Each rank reduces one chunk completely (its own, chunk `rank`);
the allgather phase then distributes that single copy, so every rank ends with the same
bits. Per rank it moves 2(p-1)/p of the buffer, the bandwidth optimum.

Messages whose chunks fit one segment skip the pipeline (in the allreduce, the
reduce-scatter and the allgather alike): each step is one Sendrecv over a precomputed
schedule (`schedule`, pure data, cached), so a small message pays a handful of
Python-level MPI calls and no per-step planning.

Cost: 2(p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma.
"""
from __future__ import annotations

import functools
import os

from mpi4py import MPI

from mpidist.collectives.ops import Op, reduce_into
from mpidist.collectives.scratch import same_view, scratch
from mpidist.partition import counts_displs

__all__ = ["allreduce", "reduce_scatter", "allgather", "segment_bytes", "schedule"]

_TAG = 301


def segment_bytes() -> int:
    """Bytes per pipelined segment (env MPIDIST_SEGMENT_BYTES, default 1 MiB).

    Without a single-copy transport or an MPI progress thread, a segment moves only while
    both neighbours are inside MPI calls and each one costs a rendezvous handshake, so
    segments stay large enough for that to be small against the copy and the reduction.
    """
    return _parse_segment_bytes(os.environ.get("MPIDIST_SEGMENT_BYTES"))


@functools.lru_cache(maxsize=8)
def _parse_segment_bytes(value: str | None) -> int:
    if not value:
        return 1 << 20
    try:
        seg = int(value)
    except ValueError:
        seg = 0
    if seg < 1:
        raise ValueError(f"MPIDIST_SEGMENT_BYTES must be a positive number of bytes, got {value!r}")
    return seg


@functools.lru_cache(maxsize=256)
def schedule(n: int, rank: int, size: int) -> tuple[tuple[int, int, int, int], ...]:
    """The 2(size-1) steps of the ring allreduce of n elements on `rank`: per step the
    element ranges (send lo, send hi, recv lo, recv hi) of the chunk sent to the right and
    the chunk received from the left. Steps 0..size-2 reduce-scatter (the last one brings
    the rank's own chunk), steps size-1.. allgather."""
    counts, displs = counts_displs(n, size)
    steps = []
    for t in range(2 * (size - 1)):
        s, q = (rank - t - 1) % size, (rank - t - 2) % size
        steps.append((displs[s], displs[s] + counts[s], displs[q], displs[q] + counts[q]))
    return tuple(steps)


def _segments(count: int, seg: int):
    return [(lo, min(lo + seg, count)) for lo in range(0, count, seg)]


def _ring_pass(mpi, nsteps: int, first, recv_target, process, seg: int) -> None:
    """Run `nsteps` ring steps. Step 0 sends `first` to the right; step t receives from the
    left into recv_target(t) segment by segment, calls process(t, lo, hi) on each segment
    and sends what it returns to the right as part of step t+1.

    From step 1 on, the receives of step t+1 are posted when step t starts, so the left
    neighbour's forwarded segments find a posted receive (three scratch buffers rotate in
    the reduce-scatter). Buffer safety: when step t starts, every send up to step t-1 has
    completed, and step t+1 writes a chunk that no pending send of step t reads.
    """
    rank, size = mpi.Get_rank(), mpi.Get_size()
    left, right = (rank - 1) % size, (rank + 1) % size

    def post(t):
        dst = recv_target(t)
        segs = _segments(len(dst), seg)
        return [mpi.Irecv(dst[lo:hi], left, _TAG) for lo, hi in segs], segs

    sends = [mpi.Isend(first[lo:hi], right, _TAG) for lo, hi in _segments(len(first), seg)]
    recvs = post(0) if nsteps else None
    for t in range(nsteps):
        ahead = post(t + 1) if 1 <= t < nsteps - 1 else None
        forward = []
        for req, (lo, hi) in zip(*recvs):
            req.Wait()
            out = process(t, lo, hi)
            if t + 1 < nsteps:
                forward.append(mpi.Isend(out, right, _TAG))
        MPI.Request.Waitall(sends)   # step t's sends: their buffers may be reused next step
        sends = forward
        recvs = ahead if ahead is not None else post(t + 1) if t + 1 < nsteps else None
    MPI.Request.Waitall(sends)


def _reduce_scatter_unsegmented(comm, sendbuf, mine, op: Op, steps) -> None:
    """The reduce-scatter steps of the schedule for chunks of one segment, one blocking
    Sendrecv each, partial sums alternating between two scratch buffers; `mine` (the
    place of my chunk, which may be that chunk of sendbuf) receives my chunk's reduction."""
    mpi, p = comm.comm, comm.size
    left, right = (comm.rank - 1) % p, (comm.rank + 1) % p
    longest = -(-len(sendbuf) // p)               # chunk 0, the longest
    work = (scratch(comm, 0, longest, sendbuf.dtype, like=sendbuf),
            scratch(comm, 1, longest, sendbuf.dtype, like=sendbuf))
    out = sendbuf[steps[0][0]:steps[0][1]]
    for t, (_, _, lo, hi) in enumerate(steps):
        got = work[t % 2][:hi - lo]
        mpi.Sendrecv(out, right, _TAG, got, left, _TAG)
        out = got if t < p - 2 else mine          # the last step brings my own chunk
        reduce_into(op, got, sendbuf[lo:hi], out)


def _allgather_unsegmented(comm, buf, steps) -> None:
    """The allgather steps of the schedule for chunks of one segment: pass the chunks of
    buf on around the ring, one blocking Sendrecv each (buf holds my chunk already)."""
    mpi, p = comm.comm, comm.size
    left, right = (comm.rank - 1) % p, (comm.rank + 1) % p
    for slo, shi, lo, hi in steps:
        mpi.Sendrecv(buf[slo:shi], right, _TAG, buf[lo:hi], left, _TAG)


def reduce_scatter(comm, sendbuf, shard, op: Op, *, finalize_n: int | None = None):
    """Ring reduce-scatter: `shard` (chunk(n, rank, size) of sendbuf's length n) receives
    the reduction of that chunk over all ranks. `shard` may be that chunk of sendbuf itself.
    finalize_n: apply op.finalize(shard, finalize_n) (the avg division) before returning."""
    mpi, p, r = comm.comm, comm.size, comm.rank
    n = len(sendbuf)
    counts, displs = counts_displs(n, p)
    seg = max(1, segment_bytes() // max(1, sendbuf.itemsize))
    if p == 1:
        if not same_view(shard, sendbuf):
            shard[...] = sendbuf
    elif n <= seg * p:                                  # every chunk is one segment
        _reduce_scatter_unsegmented(comm, sendbuf, shard, op, schedule(n, r, p)[:p - 1])
    else:
        work = [scratch(comm, k, counts[0], sendbuf.dtype, like=sendbuf) for k in range(3)]
        chunk_of = [(r - t - 1) % p for t in range(p)]   # chunk sent at step t

        def target(t):
            return work[t % 3][:counts[chunk_of[t + 1]]]

        def process(t, lo, hi):
            c = chunk_of[t + 1]
            mine = sendbuf[displs[c] + lo:displs[c] + hi]
            if t == p - 2:                               # chunk c == r: the final result
                reduce_into(op, work[t % 3][lo:hi], mine, shard[lo:hi])
                return None
            reduce_into(op, work[t % 3][lo:hi], mine, work[t % 3][lo:hi])
            return work[t % 3][lo:hi]

        c0 = chunk_of[0]
        _ring_pass(mpi, p - 1, sendbuf[displs[c0]:displs[c0] + counts[c0]], target, process, seg)
    if finalize_n is not None:
        op.finalize(shard, finalize_n)
    return shard


def allgather(comm, shard, out):
    """Ring allgather: out (length n) receives every rank's chunk(n, rank, size) shard."""
    mpi, p, r = comm.comm, comm.size, comm.rank
    n = len(out)
    counts, displs = counts_displs(n, p)
    mine = out[displs[r]:displs[r] + counts[r]]
    if not same_view(shard, mine):
        mine[...] = shard
    seg = max(1, segment_bytes() // max(1, out.itemsize))
    if 1 < p and n <= seg * p:                          # every chunk is one segment
        _allgather_unsegmented(comm, out, schedule(n, r, p)[p - 1:])
    elif p > 1:
        chunk_of = [(r - t) % p for t in range(p)]        # chunk sent at step t

        def target(t):
            c = chunk_of[t + 1]
            return out[displs[c]:displs[c] + counts[c]]

        def process(t, lo, hi):
            return target(t)[lo:hi]

        _ring_pass(mpi, p - 1, mine, target, process, seg)
    return out


def allreduce(comm, sendbuf, recvbuf, op: Op):
    """Ring allreduce of sendbuf into recvbuf (recvbuf may be sendbuf: in place).

    One pass of 2(p-1) steps: at step t rank r sends chunk (r-t-1) mod p and receives
    chunk (r-t-2) mod p, so the last reduce-scatter step flows into the first allgather
    step without a pause.
    """
    p, r = comm.size, comm.rank
    if p == 1:
        if not same_view(recvbuf, sendbuf):
            recvbuf[...] = sendbuf
        return recvbuf
    n = len(sendbuf)
    seg = max(1, segment_bytes() // max(1, sendbuf.itemsize))
    if n <= seg * p:                          # every chunk is one segment
        steps = schedule(n, r, p)
        lo, hi = steps[p - 2][2:]                 # my chunk, the last one reduced
        # 1. reduce-scatter
        _reduce_scatter_unsegmented(comm, sendbuf, recvbuf[lo:hi], op, steps[:p - 1])
        op.finalize(recvbuf[lo:hi], p)
        # 2. allgather
        _allgather_unsegmented(comm, recvbuf, steps[p - 1:])
        return recvbuf
    mpi = comm.comm
    counts, displs = counts_displs(n, p)
    work = [scratch(comm, k, counts[0], sendbuf.dtype, like=sendbuf) for k in range(3)]
    chunk_of = [(r - t - 1) % p for t in range(2 * p - 1)]   # chunk sent at step t

    def target(t):
        c = chunk_of[t + 1]
        if t < p - 1:                        # 1. reduce-scatter: partial sums arrive in scratch
            return work[t % 3][:counts[c]]
        return recvbuf[displs[c]:displs[c] + counts[c]]   # 2. allgather: final chunks

    def process(t, lo, hi):
        c = chunk_of[t + 1]
        if t >= p - 1:
            return recvbuf[displs[c] + lo:displs[c] + hi]
        got = work[t % 3][lo:hi]
        mine = sendbuf[displs[c] + lo:displs[c] + hi]
        if t < p - 2:
            reduce_into(op, got, mine, got)
            return got
        done = recvbuf[displs[c] + lo:displs[c] + hi]   # c == r: my chunk is complete
        reduce_into(op, got, mine, done)
        op.finalize(done, p)
        return done

    c0 = chunk_of[0]
    _ring_pass(mpi, 2 * (p - 1), sendbuf[displs[c0]:displs[c0] + counts[c0]], target,
               process, seg)
    return recvbuf
