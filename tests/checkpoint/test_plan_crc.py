"""The pure parts of checkpointing: CRC combining, who-writes-what, flat ranges as boxes."""
import zlib
from math import prod

import numpy as np
import pytest

from mpidist.checkpoint.crc import combine_pieces, crc32, crc32_combine
from mpidist.checkpoint.plan import assign, flat_boxes


@pytest.mark.parametrize("cuts", [[], [0], [1], [5, 5, 9], [3, 100, 1000, 4095]])
def test_crc32_combine_equals_crc_of_concatenation(cuts):
    data = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    bounds = [0] + sorted(cuts) + [len(data)]
    total = 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        total = crc32_combine(total, crc32(data[a:b]), b - a)
    assert total == zlib.crc32(data)


def test_combine_pieces_any_order_and_reports_gaps():
    x = np.arange(1000, dtype=np.float32)
    pieces = [(o, c, crc32(x[o:o + c])) for o, c in [(700, 300), (0, 250), (250, 450), (250, 0)]]
    assert combine_pieces(pieces, 4, 1000) == crc32(x)
    with pytest.raises(ValueError, match="gap"):
        combine_pieces(pieces[:2], 4, 1000)
    with pytest.raises(ValueError, match="overlap"):
        combine_pieces(pieces + [(10, 5, 0)], 4, 1000)
    with pytest.raises(ValueError, match="cover"):
        combine_pieces(pieces, 4, 1001)


def _covered_once(mine, numel):
    seen = np.zeros(numel, dtype=int)
    for ranges in mine:
        for o, c in ranges:
            seen[o:o + c] += 1
    return seen


def test_assign_replicated_tensor_is_split_evenly():
    mine, gaps = assign([[(0, 10)]] * 3, 10)
    assert gaps == [] and mine == [[(0, 4)], [(4, 3)], [(7, 3)]]


def test_assign_disjoint_shards_write_themselves():
    claims = [[(0, 4)], [(4, 3)], [], [(7, 3)]]
    mine, gaps = assign(claims, 10)
    assert mine == claims and gaps == []


def test_assign_overlaps_and_gaps():
    claims = [[(0, 6)], [(3, 7)], [(12, 3)]]
    mine, gaps = assign(claims, 16)
    assert gaps == [(10, 2), (15, 1)]
    seen = _covered_once(mine, 16)
    assert (seen[:10] == 1).all() and (seen[12:15] == 1).all() and seen[[10, 11, 15]].sum() == 0
    for r, ranges in enumerate(mine):               # nobody writes what it does not hold
        for o, c in ranges:
            assert any(a <= o and o + c <= a + n for a, n in claims[r])


def test_assign_rejects_out_of_range():
    with pytest.raises(ValueError, match="outside"):
        assign([[(5, 6)]], 10)


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 4, 5), (2, 3, 1, 4)])
def test_flat_boxes_select_exactly_the_range(shape):
    numel = prod(shape)
    for lo in range(numel + 1):
        for hi in range(lo, numel + 1, 3):
            mask = np.zeros(shape, dtype=int)
            boxes = flat_boxes(lo, hi, shape)
            assert len(boxes) <= 2 * (len(shape) - 1) + 1
            last = -1
            for start, count in boxes:
                mask[tuple(slice(s, s + c) for s, c in zip(start, count))] += 1
                first = np.ravel_multi_index(start, shape)
                assert first > last                  # boxes come in flat order
                last = first
            expect = np.zeros(numel, dtype=int)
            expect[lo:hi] = 1
            assert np.array_equal(mask.reshape(-1), expect)


def test_flat_boxes_scalar_and_errors():
    assert flat_boxes(0, 1, ()) == [((), ())]
    assert flat_boxes(0, 0, ()) == []
    with pytest.raises(ValueError):
        flat_boxes(3, 30, (4, 5))
