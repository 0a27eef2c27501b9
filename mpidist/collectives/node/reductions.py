"""The reductions over a node's Window: each rank reduces its chunk, chunk(n, rank, size), over
every rank's slice in rank order, block by block, so every rank ends with the same bits.

allreduce(w, x, y, op) of n elements:
1. publish: my input into my slice of the call's region, but for my own chunk, which only I
   read (it stays in x); barrier (with the call's digest where it is guarded);
2. reduce: my chunk over every rank's input in rank order (mine from x, the others' from
   their slices), block by block, into my own slice and into y;
3. gather: barrier; every other rank's reduced chunk out of its slice into y, each as soon
   as that rank has arrived (so a rank copies while the others still reduce).
reduce_scatter is steps 1-2 into the caller's shard, allgather publishes a shard and copies
them all. The window's two regions alternate, so a call needs no barrier after its reads.
Cost: 2 alpha (barriers) + 2 n beta (copies in and out) + n gamma; a third of the ring's
memory traffic.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mpidist.collectives import flight, guard
from mpidist.partition import counts_displs

__all__ = ["reduce_chunk", "allreduce", "begin", "ready", "finish", "reduce_scatter",
           "allgather"]


def reduce_chunk(terms, out, op, block, *, finalize_n: int | None = None, copy_to=None,
                 finite: bool = False) -> bool:
    """out = terms[0] op terms[1] op ... (same lengths, rank order), one block at a time.

    block: scratch for the running result (its length sets the block), so it stays in
    cache; out may be one of the terms (it is written last). Each block of out is finalized
    over finalize_n contributors (op.finalize), then copied into copy_to while in cache.
    finite: also test the results for Inf/NaN (an Inf or NaN among the terms of a sum gives
    one). Returns whether every result is finite (True when not tested)."""
    p, n = len(terms), out.shape[0]
    step = block.shape[0]
    ok = True
    for a in range(0, n, step):
        b = min(a + step, n)
        o = out[a:b]
        acc = block[:b - a] if p > 2 else o
        op.ufunc(terms[0][a:b], terms[1][a:b], out=acc)
        for k in range(2, p):
            op.ufunc(acc, terms[k][a:b], out=acc if k < p - 1 else o)
        if finalize_n is not None:
            op.finalize(o, finalize_n)
        if copy_to is not None:
            copy_to[a:b] = o
        if finite:
            ok = ok and bool(np.isfinite(o).all())
    return ok


class Call(NamedTuple):
    """An allreduce between begin and finish."""
    x: np.ndarray
    y: np.ndarray
    own: np.ndarray                 # my input as reduced: x, or my slice when scaled
    op: object
    signature: tuple | None
    entry: list | None              # the flight recorder's
    part: list
    counts: np.ndarray
    displs: np.ndarray
    seq: int                        # the first barrier's
    slot: int
    digest: int | None


def allreduce(w, x: np.ndarray, y: np.ndarray, op, *, signature=None, scale=None) -> None:
    """y = x (times scale, if given) reduced with op (an mpidist Op) over the ranks; y may
    be x. signature: check the call with the mismatch guard in the window (None: the caller
    has checked it)."""
    finish(w, begin(w, x, y, op, signature=signature, scale=scale))


def begin(w, x: np.ndarray, y: np.ndarray, op, *, signature=None, scale=None) -> Call:
    """Step 1 of allreduce, without waiting: publish x and arrive at the first barrier.
    finish(w, call) does the rest; ready(w, call) says whether every rank has arrived, so
    finish would not wait for a rank that has not called. A call that grows the window
    (collective) first agrees on its signature: the check then happens there, once."""
    entry = None if signature is None else flight.begin(w.comm, signature)
    try:
        digest = None
        if signature is not None:
            if w.fits(x.nbytes):
                digest = guard.digest(signature)
            else:
                w.agree(signature)
        part = w.slices(x.size, x.dtype)
        counts, displs = counts_displs(x.size, w.size)
        lo, hi = displs[w.rank], displs[w.rank] + counts[w.rank]
        mine = part[w.rank]
        # 1. publish my input (my own chunk stays in x: only I reduce it)
        if scale is None:
            own = x
            mine[:lo] = x[:lo]
            mine[hi:] = x[hi:]
        else:
            own = mine
            np.multiply(x, scale, out=mine)
        slot = w.arrive(digest)
    except BaseException:
        flight.end(entry)
        raise
    return Call(x, y, own, op, signature, entry, part, counts, displs, w.seq, slot, digest)


def ready(w, call: Call, patience: float) -> bool:
    """Whether every rank has called (arrived at call's first barrier), waiting at most
    `patience` seconds."""
    return w.wait(call.seq, patience)


def finish(w, call: Call) -> None:
    """Steps 2 and 3 of allreduce: wait for every rank, reduce my chunk, gather."""
    try:
        w.wait(call.seq)
        if not w.agreed(call.slot, call.digest):
            w.disagree(call.signature, None)
        # 2. my chunk over every rank's input, in rank order, into my slice and y
        counts, displs, part, y = call.counts, call.displs, call.part, call.y
        lo, hi = displs[w.rank], displs[w.rank] + counts[w.rank]
        terms = [call.own[lo:hi] if k == w.rank else part[k][lo:hi] for k in range(w.size)]
        reduce_chunk(terms, part[w.rank][lo:hi], call.op, w.block(y.dtype),
                     finalize_n=w.size, copy_to=y[lo:hi])
        # 3. the others' reduced chunks, each once its rank has reduced it
        w.arrive()
        for j in w.arrivals(w.seq):
            y[displs[j]:displs[j] + counts[j]] = part[j][displs[j]:displs[j] + counts[j]]
    finally:
        flight.end(call.entry)


def reduce_scatter(w, x: np.ndarray, shard: np.ndarray, op, *,
                   finalize_n: int | None = None) -> None:
    """Steps 1 and 2 of allreduce: my chunk of x reduced over the ranks, into shard (which
    may be that chunk of x); finalized over finalize_n contributors where given."""
    part = w.slices(x.size, x.dtype)
    counts, displs = counts_displs(x.size, w.size)
    lo, hi = displs[w.rank], displs[w.rank] + counts[w.rank]
    # 1. publish my input but my own chunk
    part[w.rank][:lo] = x[:lo]
    part[w.rank][hi:] = x[hi:]
    w.barrier()
    # 2. my chunk over every rank's input, in rank order, into shard
    terms = [x[lo:hi] if k == w.rank else part[k][lo:hi] for k in range(w.size)]
    reduce_chunk(terms, shard, op, w.block(x.dtype), finalize_n=finalize_n)


def allgather(w, shard: np.ndarray, out: np.ndarray) -> None:
    """out = every rank's shard, chunk(len(out), r, size) of it from rank r: mine published
    at its place in my slice, barrier, the others' copied out of theirs."""
    part = w.slices(out.size, out.dtype)
    counts, displs = counts_displs(out.size, w.size)
    lo, hi = displs[w.rank], displs[w.rank] + counts[w.rank]
    part[w.rank][lo:hi] = shard
    w.barrier()
    out[lo:hi] = shard
    for j in range(w.size):
        if j != w.rank:
            out[displs[j]:displs[j] + counts[j]] = part[j][displs[j]:displs[j] + counts[j]]
