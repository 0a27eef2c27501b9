"""Ring allreduce: a reduce-scatter then an allgather around the ring r -> r+1.

Each of the 2(p-1) steps moves one chunk (the chunk() partition of the buffer) to the right
neighbour; `steps` says which, and the compressed ring (mpidist.compress.ring) follows the
same schedule. Each rank reduces one chunk completely, its own; the allgather distributes
that single copy, so every rank ends with the same bits. Per rank it moves 2(p-1)/p of the
buffer, the bandwidth optimum.

Chunks larger than one segment are pipelined: segments move with nonblocking calls and one
is forwarded as soon as it has been reduced, so sending, receiving and reducing overlap
along the ring, and across nodes several segments in flight keep the link busy. Smaller
chunks, and two ranks on one node (where nothing received is forwarded and shared memory
has no handshake to hide, so segments only add rendezvous), take one Sendrecv per step
over a cached schedule.

Cost: 2(p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma.
"""
from __future__ import annotations

import collections
import functools
import os
import time
import weakref

from mpi4py import MPI

from mpidist.collectives.ops import Op, reduce_into
from mpidist.collectives.workspace import same_view, scratch
from mpidist.collectives.waits import sendrecv, waitany
from mpidist.mpienv import segment_bytes
from mpidist.partition import counts_displs

__all__ = ["allreduce", "reduce_scatter", "allgather", "steps", "schedule", "segments"]

_TAG = 301
_WORK = ("ring.work.0", "ring.work.1", "ring.work.2")     # scratch: partial sums in flight
PACE_ABOVE = 4e-3        # seconds a segment takes on the wire, above which sends are paced
_PACING = ("auto", "on", "off")
# comm -> (the last step's seconds per segment, the lesser of the last two steps')
_segment_seconds: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def paced(comm) -> bool:
    """Whether the ring keeps one send in flight rather than all (_Pipeline says why):
    env MPIDIST_RING_PACING, "auto" (the default), "on" or "off". auto paces a ring across
    nodes whose segments took over PACE_ABOVE on the wire in each of the last two measured
    steps (one step slowed by something else does not decide it): on a slow link the
    handshake that pacing adds before each segment is small against the segment, and on a
    fast one it is not."""
    mode = os.environ.get("MPIDIST_RING_PACING", "auto") or "auto"
    if mode not in _PACING:
        raise ValueError(f"MPIDIST_RING_PACING must be one of {', '.join(_PACING)}, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    return comm.num_nodes > 1 and _segment_seconds.get(comm, (0.0, 0.0))[1] > PACE_ABOVE


def _whole_chunks(comm, n: int, seg: int) -> bool:
    """Whether the ring moves whole chunks, one Sendrecv per step, rather than segments:
    every chunk fits one segment, or the ring has two ranks on one node. Across nodes two
    ranks segment too: several segments in flight keep the link busy through each one's
    rendezvous handshake, where one whole chunk leaves it idle for them."""
    return (comm.size <= 2 and comm.num_nodes == 1) or n <= seg * comm.size


def segments(lo: int, hi: int, seg: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into consecutive (start, stop) pieces of at most seg elements."""
    return [(a, min(a + seg, hi)) for a in range(lo, hi, seg)]


@functools.lru_cache(maxsize=256)
def steps(own: int, size: int) -> tuple[tuple[int, int], ...]:
    """The 2(size-1) steps of the ring on the rank that ends up reducing chunk `own`: per
    step, (the chunk it sends to the right, the chunk it receives from the left).

    Steps 0..size-2 reduce-scatter (the last one brings chunk `own`, complete), steps
    size-1.. allgather (the first one sends it on)."""
    return tuple(((own - t - 1) % size, (own - t - 2) % size) for t in range(2 * (size - 1)))


@functools.lru_cache(maxsize=256)
def schedule(n: int, rank: int, size: int) -> tuple[tuple[int, int, int, int], ...]:
    """steps(rank, size) as element ranges of an n-element buffer: per step (send lo,
    send hi, recv lo, recv hi)."""
    counts, displs = counts_displs(n, size)
    return tuple((displs[s], displs[s] + counts[s], displs[q], displs[q] + counts[q])
                 for s, q in steps(rank, size))


class _Pipeline:
    """The segmented transfers of consecutive ring steps: step t receives from the left
    into into[t], segment by segment (`arrivals`); what the caller forwards during step t
    goes to the right as part of step t+1.

    From step 1 on, the receives of step t+1 are posted when step t starts, so the left
    neighbour's forwarded segments find a posted receive. Buffer safety: when step t starts,
    every send up to step t-1 has completed, and step t+1 writes a buffer that no pending
    send of step t reads (three scratch buffers rotate in the reduce-scatter).

    Paced, one send is in flight at a time, so segments leave in order: a transport that
    moves large messages by rendezvous in fragments (TCP) interleaves the fragments of every
    message in flight, so with all of them posted at once they all arrive at the end of the
    step, and the receiver, with nothing to reduce or forward until then, leaves the link
    idle. Each step after the first (both neighbours inside the call by then) measures how
    long its segments took, for `paced` to decide the next call.
    """

    def __init__(self, comm, into: list, first, seg: int):
        self.comm, self.mpi, self.into, self.seg = comm, comm.comm, into, seg
        self.depth = 1 if paced(comm) else 1 << 30
        self.left, self.right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
        self.queue = collections.deque(first[lo:hi] for lo, hi in segments(0, len(first), seg))
        self.flying: list = []             # sends in flight, and their sequence numbers
        self.numbers: list[int] = []
        self.posted = 0                    # sends posted so far
        self.step_first, self.step_sends = 0, len(self.queue)   # this step's sends: [first, sends)
        self._pump()
        self.recvs = self._post(0)
        self.began = None                  # when the step that is measured began

    def _post(self, t: int):
        dst = self.into[t]
        segs = segments(0, len(dst), self.seg)
        return [self.mpi.Irecv(dst[lo:hi], self.left, _TAG) for lo, hi in segs], segs

    def _pump(self) -> None:
        while self.queue and len(self.flying) < self.depth:
            self.flying.append(self.mpi.Isend(self.queue.popleft(), self.right, _TAG))
            self.numbers.append(self.posted)
            self.posted += 1

    def _step_sent(self) -> bool:
        return self.posted >= self.step_sends and all(k >= self.step_sends for k in self.numbers)

    def _until(self, req=None) -> None:
        """Wait for req (None: for this step's sends), posting queued sends as those in
        flight complete."""
        while req if req is not None else not self._step_sent():
            head = [req] if req is not None else []
            i = waitany(head + self.flying) - len(head)
            if i < 0:
                return
            del self.flying[i], self.numbers[i]
            self._pump()

    def arrivals(self, t: int):
        """Step t: yield (lo, hi) of each segment of into[t] once it has arrived."""
        last = len(self.into) - 1
        ahead = self._post(t + 1) if 1 <= t < last else None
        for req, seg in zip(*self.recvs):
            self._until(req)
            yield seg
        self._end_step()  # step t's sends: their buffers may be reused next step
        self.recvs = ahead if ahead is not None else self._post(t + 1) if t < last else None

    def forward(self, view) -> None:
        """Send view (a reduced or received segment) to the right, as part of the next step."""
        self.queue.append(view)
        self._pump()

    def close(self) -> None:
        self._end_step()

    def _end_step(self) -> None:
        """Complete this step's sends; from the second step on, record their time per segment."""
        self._until()
        now, count = time.perf_counter(), self.step_sends - self.step_first
        if self.began is not None and count > 1:
            last = (now - self.began) / count
            before = _segment_seconds.get(self.comm, (last,))[0]
            _segment_seconds[self.comm] = (last, min(last, before))
        self.began, self.step_first = now, self.step_sends
        self.step_sends = self.posted + len(self.queue)


def _reduce_scatter_unsegmented(comm, sendbuf, mine, op: Op, plan) -> None:
    """The reduce-scatter steps of schedule `plan` moving whole chunks, one blocking
    Sendrecv each, partial sums alternating between two scratch buffers; `mine` (the
    place of my chunk, which may be that chunk of sendbuf) receives my chunk's reduction."""
    mpi, p = comm.comm, comm.size
    left, right = (comm.rank - 1) % p, (comm.rank + 1) % p
    longest = -(-len(sendbuf) // p)               # chunk 0, the longest
    work = (scratch(comm, _WORK[0], longest, sendbuf.dtype, like=sendbuf),
            scratch(comm, _WORK[1], longest, sendbuf.dtype, like=sendbuf))
    out = sendbuf[plan[0][0]:plan[0][1]]
    for t, (_, _, lo, hi) in enumerate(plan):
        got = work[t % 2][:hi - lo]
        sendrecv(mpi, out, right, _TAG, got, left, _TAG)
        out = got if t < p - 2 else mine          # the last step brings my own chunk
        reduce_into(op, got, sendbuf[lo:hi], out)


def _allgather_unsegmented(comm, buf, plan) -> None:
    """The allgather steps of schedule `plan` moving whole chunks: pass the chunks of
    buf on around the ring, one blocking Sendrecv each (buf holds my chunk already)."""
    mpi, p = comm.comm, comm.size
    left, right = (comm.rank - 1) % p, (comm.rank + 1) % p
    for slo, shi, lo, hi in plan:
        sendrecv(mpi, buf[slo:shi], right, _TAG, buf[lo:hi], left, _TAG)


def _parts(buf, n: int, size: int):
    """part(c): chunk c of buf, a view."""
    counts, displs = counts_displs(n, size)
    return lambda c: buf[displs[c]:displs[c] + counts[c]]


def _work(comm, n: int, like) -> list:
    """The three rotating scratch buffers of the pipelined reduce-scatter."""
    longest = -(-n // comm.size)                  # chunk 0, the longest
    return [scratch(comm, name, longest, like.dtype, like=like) for name in _WORK]


def reduce_scatter(comm, sendbuf, shard, op: Op, *, finalize_n: int | None = None):
    """Ring reduce-scatter: `shard` (chunk(n, rank, size) of sendbuf's length n) receives
    the reduction of that chunk over all ranks. `shard` may be that chunk of sendbuf itself.
    finalize_n: apply op.finalize(shard, finalize_n) (the avg division) before returning."""
    p, r, n = comm.size, comm.rank, len(sendbuf)
    seg = max(1, segment_bytes() // max(1, sendbuf.itemsize))
    if p == 1:
        if not same_view(shard, sendbuf):
            shard[...] = sendbuf
    elif _whole_chunks(comm, n, seg):
        _reduce_scatter_unsegmented(comm, sendbuf, shard, op, schedule(n, r, p)[:p - 1])
    else:
        plan, part, work = steps(r, p)[:p - 1], _parts(sendbuf, n, p), _work(comm, n, sendbuf)
        into = [work[t % 3][:len(part(c))] for t, (_, c) in enumerate(plan)]
        ring = _Pipeline(comm, into, part(plan[0][0]), seg)
        for t, (_, c) in enumerate(plan):
            got, mine = into[t], part(c)
            for lo, hi in ring.arrivals(t):
                if t < p - 2:                           # a partial sum: add mine, pass it on
                    reduce_into(op, got[lo:hi], mine[lo:hi], got[lo:hi])
                    ring.forward(got[lo:hi])
                else:                                   # chunk c == r: the result
                    reduce_into(op, got[lo:hi], mine[lo:hi], shard[lo:hi])
        ring.close()
    if finalize_n is not None:
        op.finalize(shard, finalize_n)
    return shard


def allgather(comm, shard, out):
    """Ring allgather: out (length n) receives every rank's chunk(n, rank, size) shard."""
    p, r, n = comm.size, comm.rank, len(out)
    part = _parts(out, n, p)
    if not same_view(shard, part(r)):
        part(r)[...] = shard
    seg = max(1, segment_bytes() // max(1, out.itemsize))
    if p == 1:
        return out
    if _whole_chunks(comm, n, seg):
        _allgather_unsegmented(comm, out, schedule(n, r, p)[p - 1:])
        return out
    plan = steps(r, p)[p - 1:]
    into = [part(c) for _, c in plan]
    ring = _Pipeline(comm, into, part(r), seg)
    for t in range(p - 1):
        for lo, hi in ring.arrivals(t):
            if t < p - 2:                               # pass it on, but the last
                ring.forward(into[t][lo:hi])
    ring.close()
    return out


def allreduce(comm, sendbuf, recvbuf, op: Op):
    """Ring allreduce of sendbuf into recvbuf (recvbuf may be sendbuf: in place).

    One pass of the 2(p-1) steps of steps(rank, p): the last reduce-scatter step, which
    completes my chunk, flows into the first allgather step without a pause.
    """
    p, r, n = comm.size, comm.rank, len(sendbuf)
    if p == 1:
        if not same_view(recvbuf, sendbuf):
            recvbuf[...] = sendbuf
        return recvbuf
    seg = max(1, segment_bytes() // max(1, sendbuf.itemsize))
    if _whole_chunks(comm, n, seg):
        plan = schedule(n, r, p)
        lo, hi = plan[p - 2][2:]                        # my chunk, the last one reduced
        # 1. reduce-scatter
        _reduce_scatter_unsegmented(comm, sendbuf, recvbuf[lo:hi], op, plan[:p - 1])
        op.finalize(recvbuf[lo:hi], p)
        # 2. allgather
        _allgather_unsegmented(comm, recvbuf, plan[p - 1:])
        return recvbuf
    plan, work = steps(r, p), _work(comm, n, sendbuf)
    mine, result = _parts(sendbuf, n, p), _parts(recvbuf, n, p)
    # partial sums arrive in scratch during the reduce-scatter, final chunks in recvbuf
    into = [work[t % 3][:len(mine(c))] for t, (_, c) in enumerate(plan[:p - 1])] + \
        [result(c) for _, c in plan[p - 1:]]
    ring = _Pipeline(comm, into, mine(plan[0][0]), seg)
    # 1. reduce-scatter: add my part to each arriving partial sum and pass it on; the last
    #    step brings my own chunk, complete
    for t, (_, c) in enumerate(plan[:p - 1]):
        got, add = into[t], mine(c)
        for lo, hi in ring.arrivals(t):
            if t < p - 2:
                reduce_into(op, got[lo:hi], add[lo:hi], got[lo:hi])
                ring.forward(got[lo:hi])
            else:                                       # chunk c == r
                done = result(c)[lo:hi]
                reduce_into(op, got[lo:hi], add[lo:hi], done)
                op.finalize(done, p)
                ring.forward(done)
    # 2. allgather: pass each arriving final chunk on, but the last
    for t in range(p - 1, 2 * (p - 1)):
        for lo, hi in ring.arrivals(t):
            if t < 2 * p - 3:
                ring.forward(into[t][lo:hi])
    ring.close()
    return recvbuf
