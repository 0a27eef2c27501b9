"""Pure bookkeeping of checkpoint I/O: who writes which elements, and how a flat range of a
row-major tensor maps onto HDF5 hyperslabs. No MPI, no files; tested on its own.
"""
from __future__ import annotations

from math import prod

from mpidist.partition import chunk

__all__ = ["assign", "flat_boxes"]


def assign(claims: list[list[tuple[int, int]]], numel: int):
    """Split the elements that ranks hold among them so that each is handled exactly once.

    claims[r]: the (offset, count) flat ranges rank r holds (overlaps allowed: a replicated
    tensor is held whole by every rank). Each stretch held by the same set of ranks is split
    among them with chunk(), so a replicated tensor is written in parallel, 1/size each.
    Returns (mine, gaps): mine[r] is rank r's sorted list of (offset, count); gaps lists the
    ranges nobody holds. Every rank computes the same answer from the same claims.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    cuts = {0, numel}
    for r, ranges in enumerate(claims):
        for off, cnt in ranges:
            if off < 0 or cnt < 0 or off + cnt > numel:
                raise ValueError(f"rank {r} claims elements [{off}, {off + cnt}) outside "
                                 f"[0, {numel})")
            if cnt:
                cuts.update((off, off + cnt))
    cuts = sorted(cuts)
    mine: list[list[tuple[int, int]]] = [[] for _ in claims]
    gaps: list[tuple[int, int]] = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        holders = [r for r, ranges in enumerate(claims)
                   if any(off <= lo and hi <= off + cnt for off, cnt in ranges)]
        if not holders:
            _append(gaps, lo, hi - lo)
            continue
        for i, r in enumerate(holders):
            o, c = chunk(hi - lo, i, len(holders))
            if c:
                _append(mine[r], lo + o, c)
    return mine, gaps


def _append(ranges: list, off: int, cnt: int) -> None:
    """Append (off, cnt), merging with the last range when they touch."""
    if ranges and ranges[-1][0] + ranges[-1][1] == off:
        ranges[-1] = (ranges[-1][0], ranges[-1][1] + cnt)
    else:
        ranges.append((off, cnt))


def flat_boxes(lo: int, hi: int, shape: tuple) -> list[tuple[tuple, tuple]]:
    """The flat row-major range [lo, hi) of a tensor of `shape` as (start, count) boxes.

    At most 2 * (ndim - 1) + 1 boxes: a partial row, whole rows, a partial row, recursively.
    Boxes come in increasing flat order, which is the order HDF5 visits a selection.
    """
    shape = tuple(int(s) for s in shape)
    if not 0 <= lo <= hi <= prod(shape):
        raise ValueError(f"range [{lo}, {hi}) outside a tensor of shape {shape}")
    if lo == hi:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    inner = prod(shape[1:])
    rest = shape[1:]
    r0, o0 = divmod(lo, inner)
    r1, o1 = divmod(hi, inner)

    def row(r, a, b):
        return [((r,) + s, (1,) + c) for s, c in flat_boxes(a, b, rest)]

    if r0 == r1:
        return row(r0, o0, o1)
    boxes = []
    if o0:
        boxes += row(r0, o0, inner)
        r0 += 1
    if r1 > r0:
        boxes.append(((r0,) + (0,) * len(rest), (r1 - r0,) + rest))
    if o1:
        boxes += row(r1, 0, o1)
    return boxes
