"""How an optimizer's element range is cut into work for the kernels.

An optimizer owns [offset, offset+count) of a Layout; the kernels need that range clipped to
each tensor (pieces) and cut into bounded work items (chunks), all in local coordinates.
See docs/ARCHITECTURE.md (optim).
"""
from __future__ import annotations

import numpy as np

from mpidist.flat import Layout

__all__ = ["Plan", "CHUNK"]

CHUNK = 1 << 15     # elements per CPU work item (128 KiB of float32: stays in L2 per pass)


class Plan:
    """How [offset, offset+count) is cut for the kernels (all in local coordinates):
    pieces  -- the range clipped to each segment: pbounds (npiece+1), pseg (npiece);
    chunks  -- pieces cut into work items of at most `chunk` elements: lo, hi, seg.
    Segment indices are the layout's, so per-segment arrays have len(layout) entries."""

    def __init__(self, layout: Layout, offset: int, count: int, chunk: int = CHUNK):
        self._args = (layout, offset, count, chunk)
        pieces = layout.clip(offset, offset + count)
        self.nseg = len(layout)
        self.pseg = np.array([s for s, _, _ in pieces], np.int64)
        self.pbounds = np.array([0] + [b - offset for _, _, b in pieces], np.int64)
        lo, hi, seg = [], [], []
        for s, a, b in pieces:
            starts = np.arange(a, b, chunk, dtype=np.int64)
            lo.append(starts - offset)
            hi.append(np.minimum(starts + chunk, b) - offset)
            seg.append(np.full(starts.shape, s, np.int64))
        cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))
        self.lo, self.hi, self.seg = cat(lo), cat(hi), cat(seg)

    def only(self, segments) -> "Plan":
        """The same range with chunks only in the segments marked True (bool, one per layout
        segment): a pass over some tensors. pieces still describe the whole range, so
        kernels that walk pieces (the GPU ones) cannot take it."""
        sub = Plan(*self._args)
        keep = np.asarray(segments, bool)[sub.seg]
        sub.lo, sub.hi, sub.seg = sub.lo[keep], sub.hi[keep], sub.seg[keep]
        return sub
