"""Flat parameter buffers: every tensor of a model packed into one contiguous buffer, with a
table of (name, offset, shape) segments.

One buffer lets a kernel update all tensors in one pass, a bucket be a contiguous range, and
a ZeRO / parameter-server / checkpoint shard be a plain [offset, offset+count) slice from
`chunk()`. Per-tensor (layer-wise) quantities are segmented reductions over the table.
See docs/ARCHITECTURE.md (foundation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from mpidist.kernels.backend import get_array_module
from mpidist.partition import chunk

__all__ = ["Segment", "Layout", "FlatBuffer"]


@dataclass(frozen=True)
class Segment:
    """One tensor inside a flat buffer."""
    name: str
    offset: int
    shape: tuple[int, ...]
    size: int
    index: int

    @property
    def stop(self) -> int:
        return self.offset + self.size


class Layout:
    """The segment table of a flat buffer, in the order given (no padding between tensors)."""

    def __init__(self, named_shapes: Iterable[tuple[str, Sequence[int]]]):
        segments, offset, seen = [], 0, set()
        for index, (name, shape) in enumerate(named_shapes):
            if not isinstance(name, str) or not name:
                raise TypeError(f"segment names must be non-empty strings, got {name!r}")
            if name in seen:
                raise ValueError(f"duplicate segment name {name!r}")
            shape = tuple(int(d) for d in shape) if np.ndim(shape) else (int(shape),)
            if any(d < 0 for d in shape):
                raise ValueError(f"segment {name!r} has a negative dimension: {shape}")
            size = int(np.prod(shape, dtype=np.int64))
            segments.append(Segment(name, offset, shape, size, index))
            seen.add(name)
            offset += size
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.numel: int = offset
        self.names: tuple[str, ...] = tuple(s.name for s in segments)
        self.bounds: np.ndarray = np.array([s.offset for s in segments] + [offset], dtype=np.int64)
        self._by_name = {s.name: s for s in segments}

    def __len__(self) -> int:
        return len(self.segments)

    def __iter__(self):
        return iter(self.segments)

    def __getitem__(self, name: str) -> Segment:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no segment {name!r}; segments: {', '.join(self.names)}") from None

    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and [(s.name, s.shape) for s in self] == \
            [(s.name, s.shape) for s in other]

    def __hash__(self) -> int:
        return hash(tuple((s.name, s.shape) for s in self))

    def __repr__(self) -> str:
        return f"Layout({len(self)} segments, {self.numel} elements)"

    def views(self, flat) -> dict:
        """{name: view of flat reshaped to the segment's shape}; flat covers the whole layout."""
        if flat.ndim != 1 or flat.shape[0] != self.numel:
            raise ValueError(f"flat buffer must be 1-D with {self.numel} elements, "
                             f"got shape {flat.shape}")
        return {s.name: flat[s.offset:s.stop].reshape(s.shape) for s in self.segments}

    def clip(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(segment index, start, stop) of every segment overlapping [lo, hi), global coords."""
        lo, hi = max(0, int(lo)), min(self.numel, int(hi))
        if hi <= lo:
            return []
        first = int(np.searchsorted(self.bounds, lo, side="right")) - 1
        out = []
        for s in self.segments[first:]:
            if s.offset >= hi:
                break
            start, stop = max(lo, s.offset), min(hi, s.stop)
            if stop > start:
                out.append((s.index, start, stop))
        return out

    def segment_ids(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """int32 segment index of each element of [lo, hi) (for segmented kernels)."""
        hi = self.numel if hi is None else hi
        ids = np.empty(max(0, hi - lo), dtype=np.int32)
        for index, start, stop in self.clip(lo, hi):
            ids[start - lo:stop - lo] = index
        return ids

    def shard(self, rank: int, size: int) -> tuple[int, int]:
        """(offset, count) of rank's shard of the flat buffer: the shared chunk() partition."""
        return chunk(self.numel, rank, size)

    def subset(self, names: Iterable[str]) -> "Layout":
        """A layout of only these segments, packed in the given order."""
        return Layout((n, self[n].shape) for n in names)


class FlatBuffer:
    """One contiguous 1-D array for a whole Layout, with named views into it."""

    def __init__(self, layout: Layout, dtype=np.float32, xp=np, data=None):
        self.layout = layout
        if data is None:
            data = xp.zeros(layout.numel, dtype=dtype)
        elif data.ndim != 1 or data.shape[0] != layout.numel:
            raise ValueError(f"data must be 1-D with {layout.numel} elements, got {data.shape}")
        self.data = data
        self._views = layout.views(data)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def xp(self):
        return get_array_module(self.data)

    def view(self, name: str):
        if name not in self._views:
            self.layout[name]  # raises the KeyError listing the names
        return self._views[name]

    def views(self) -> dict:
        return dict(self._views)

    def zeros_like(self, dtype=None) -> "FlatBuffer":
        return FlatBuffer(self.layout, data=self.xp.zeros_like(self.data, dtype=dtype))

    def copy(self) -> "FlatBuffer":
        return FlatBuffer(self.layout, data=self.data.copy())

    @classmethod
    def pack(cls, named_arrays: Sequence[tuple[str, object]], dtype=None) -> "FlatBuffer":
        """A FlatBuffer holding copies of the given arrays (one dtype, one array module)."""
        named_arrays = list(named_arrays)
        if not named_arrays:
            raise ValueError("pack needs at least one array")
        xp = get_array_module(*[a for _, a in named_arrays])
        dtype = dtype or named_arrays[0][1].dtype
        layout = Layout((n, a.shape) for n, a in named_arrays)
        buf = cls(layout, dtype=dtype, xp=xp)
        for name, a in named_arrays:
            buf.view(name)[...] = a
        return buf
