"""Ring allreduce: a reduce-scatter then an allgather around the ring r -> r+1.

Each of the 2(p-1) steps moves one chunk (chunk() partition of the buffer) to the right
neighbour. Chunks are cut into segments (slices) sent and received with nonblocking
calls, and a segment is forwarded as soon as it has been reduced, so sending, receiving
and reducing overlap along the ring; each slice runs through every step before the next
one starts, so the scratch memory is a few segments whatever the message size. Each rank reduces one chunk completely (its own, chunk `rank`);
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


_TAG_FIRST = _TAG + 1       # step 0's slices, all sent at once
_AHEAD = 2                  # receives posted ahead of the segment being waited for
_SLOTS = 2 * _AHEAD         # scratch segments: posted receives + forwards still in flight


def _ring_pass(comm, first, steps, process, seg: int) -> None:
    """Run the ring steps slice by slice, as NCCL orders them: slice j (elements
    [j*seg, (j+1)*seg) of every chunk) goes through all the steps before slice j+1 starts.

    first = (chunk, array): what step 0 sends to the right. steps[t] = (chunk, count, dest):
    at step t this rank receives `count` elements of that chunk from the left, a slice at a
    time, into dest[lo:hi], or where dest is None into one of _SLOTS rotating segment-sized
    scratch buffers; process(t, lo, hi, got) handles each received slice and returns what
    to send on to the right (that slice of step t+1), or None.

    A slice forwarded at step t is the right neighbour's very next receive, so a few
    segments of scratch serve any message size (a step-major order would need a
    chunk-sized buffer per step in flight, 3n/p) and the slots stay in cache. Step 0's
    slices read the caller's input, so all of them are sent at once, under their own tag;
    the forwards reach the right neighbour in the order it posts their receives.
    Buffer safety: a slot is reused once the forward reading it has completed; a receive
    into caller memory first completes any send still reading that slice of that chunk
    (in place, step 0 sends the chunk the allgather later overwrites). In place, the
    reduce-scatter reads a slice of its own input before the allgather overwrites it: the
    overwriting data is the chunk's total, which cannot exist before this rank has sent
    its share of it.
    """
    mpi, p = comm.comm, comm.size
    left, right = (comm.rank - 1) % p, (comm.rank + 1) % p
    c0, src = first
    longest = max([len(src)] + [count for _, count, _ in steps])
    plan = [(j * seg, t) for j in range(-(-longest // seg))
            for t, (_, count, _) in enumerate(steps) if j * seg < count]
    slots = scratch(comm, 0, _SLOTS * seg, src.dtype, like=src) \
        if any(dest is None for _, _, dest in steps) else None
    forwarding = [None] * _SLOTS              # the send still reading each slot
    reading = {}                              # (chunk, lo) of caller memory -> its send

    def post(g):
        lo, t = plan[g]
        c, count, dest = steps[t]
        hi = min(lo + seg, count)
        if dest is None:
            k = g % _SLOTS
            if forwarding[k] is not None:
                forwarding[k].Wait()
                forwarding[k] = None
            got = slots[k * seg:k * seg + hi - lo]
        else:
            pending = reading.pop((c, lo), None)
            if pending is not None:
                pending.Wait()
            got = dest[lo:hi]
        return mpi.Irecv(got, left, _TAG_FIRST if t == 0 else _TAG), got

    for lo, hi in _segments(len(src), seg):
        reading[c0, lo] = mpi.Isend(src[lo:hi], right, _TAG_FIRST)
    posted = [post(g) for g in range(min(_AHEAD, len(plan)))]
    for g, (lo, t) in enumerate(plan):
        req, got = posted.pop(0)
        req.Wait()
        out = process(t, lo, lo + len(got), got)
        if out is not None and t + 1 < len(steps):
            req = mpi.Isend(out, right, _TAG)
            if out is got and steps[t][2] is None:
                forwarding[g % _SLOTS] = req
            else:
                reading[steps[t][0], lo] = req
        if g + _AHEAD < len(plan):
            posted.append(post(g + _AHEAD))
    MPI.Request.Waitall([r for r in forwarding if r is not None] + list(reading.values()))


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
        steps = [((r - t - 2) % p, counts[(r - t - 2) % p], None) for t in range(p - 1)]

        def process(t, lo, hi, got):
            c = steps[t][0]
            mine = sendbuf[displs[c] + lo:displs[c] + hi]
            if t == p - 2:                               # chunk c == r: the final result
                reduce_into(op, got, mine, shard[lo:hi])
                return None
            reduce_into(op, got, mine, got)
            return got

        c0 = (r - 1) % p
        _ring_pass(comm, (c0, sendbuf[displs[c0]:displs[c0] + counts[c0]]), steps, process, seg)
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
        steps = []
        for t in range(p - 1):                          # step t brings chunk r-t-1
            c = (r - t - 1) % p
            steps.append((c, counts[c], out[displs[c]:displs[c] + counts[c]]))
        _ring_pass(comm, (r, mine), steps, lambda t, lo, hi, got: got, seg)
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
    counts, displs = counts_displs(n, p)
    steps = []
    for t in range(2 * (p - 1)):                 # step t brings chunk r-t-2
        c = (r - t - 2) % p
        dest = None if t < p - 1 else recvbuf[displs[c]:displs[c] + counts[c]]
        steps.append((c, counts[c], dest))      # 1. reduce-scatter into scratch, 2. allgather

    def process(t, lo, hi, got):
        if t >= p - 1:
            return got
        c = steps[t][0]
        mine = sendbuf[displs[c] + lo:displs[c] + hi]
        if t < p - 2:
            reduce_into(op, got, mine, got)
            return got
        done = recvbuf[displs[c] + lo:displs[c] + hi]   # c == r: my chunk is complete
        reduce_into(op, got, mine, done)
        op.finalize(done, p)
        return done

    c0 = (r - 1) % p
    _ring_pass(comm, (c0, sendbuf[displs[c0]:displs[c0] + counts[c0]]), steps, process, seg)
    return recvbuf
