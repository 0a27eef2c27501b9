"""Flat parameter buffers: layout table, views, clipping to shards (no MPI)."""
import numpy as np
import pytest

from mpidist.flat import FlatBuffer, Layout
from mpidist.partition import chunk

SHAPES = [("a.w", (3, 4)), ("a.b", (4,)), ("b.w", (4, 2)), ("b.b", (2,)), ("scalar", ())]


def test_layout_offsets_and_views_share_memory():
    layout = Layout(SHAPES)
    assert layout.numel == 12 + 4 + 8 + 2 + 1
    assert [s.offset for s in layout] == [0, 12, 16, 24, 26]
    assert list(layout.bounds) == [0, 12, 16, 24, 26, 27]
    buf = FlatBuffer(layout, dtype=np.float64)
    buf.view("b.w")[...] = 7.0
    assert buf.data[16:24].tolist() == [7.0] * 8
    assert buf.view("scalar").shape == ()
    assert buf.view("a.w").shape == (3, 4)
    with pytest.raises(KeyError, match="segments: a.w"):
        buf.view("nope")


def test_clip_and_segment_ids_cover_shards_exactly():
    layout = Layout(SHAPES)
    for size in (1, 2, 3, 4, 5, 27, 30):
        seen = np.zeros(layout.numel, dtype=int)
        for r in range(size):
            lo, count = layout.shard(r, size)
            assert (lo, count) == chunk(layout.numel, r, size)
            ids = layout.segment_ids(lo, lo + count)
            for index, start, stop in layout.clip(lo, lo + count):
                seg = layout.segments[index]
                assert seg.offset <= start < stop <= seg.stop
                seen[start:stop] += 1
                assert (ids[start - lo:stop - lo] == index).all()
        assert (seen == 1).all()


def test_pack_and_bad_input():
    a, b = np.arange(6.0).reshape(2, 3), np.ones(4)
    buf = FlatBuffer.pack([("a", a), ("b", b)])
    assert buf.data.tolist() == [0, 1, 2, 3, 4, 5, 1, 1, 1, 1]
    assert Layout([("a", (2, 3)), ("b", (4,))]) == buf.layout
    with pytest.raises(ValueError, match="duplicate"):
        Layout([("a", (1,)), ("a", (2,))])
    with pytest.raises(ValueError, match="negative"):
        Layout([("a", (-1,))])
    with pytest.raises(ValueError, match="1-D with 10"):
        FlatBuffer(buf.layout, data=np.zeros(9))
