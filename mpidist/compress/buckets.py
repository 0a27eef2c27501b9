"""Which bucket of a flat gradient a buffer is: its key (offset, length) inside the array
it views, the same on every rank and after a restart, so each bucket keeps its own
compressor state; and the part of a layout it covers (PowerSGD needs whole matrices).
"""
from __future__ import annotations

import numpy as np

from mpidist.kernels.backend import is_cupy

__all__ = ["bucket_key", "bucket_layout"]


def _address(a) -> int:
    return a.data.ptr if hasattr(a.data, "ptr") else a.__array_interface__["data"][0]


def bucket_key(buf) -> tuple[int, int]:
    """(element offset of buf inside the array it views, length): the same for the same
    bucket of a persistent flat buffer on every rank and after a restart."""
    base = buf
    while isinstance(getattr(base, "base", None), np.ndarray) or \
            is_cupy(getattr(base, "base", None)):     # not past the array: a torch tensor
        base = base.base
    offset = (_address(buf) - _address(base)) // buf.dtype.itemsize if base is not buf else 0
    return int(offset), int(buf.shape[0])


def bucket_layout(layout, buf):
    """(the layout of the segments bucket buf covers, None), or (None, ValueError) when it
    cuts a segment."""
    lo, n = bucket_key(buf)
    parts = layout.clip(lo, lo + n)
    if not parts or any(start != layout.segments[i].offset or stop != layout.segments[i].stop
                        for i, start, stop in parts):
        return None, ValueError(f"bucket [{lo}, {lo + n}) does not cover whole segments of "
                                f"the layout; pass the bucket's own layout")
    return layout.subset(layout.segments[i].name for i, _, _ in parts), None
