"""chunk(): the one partition, tested without MPI."""
import pytest

from mpidist.partition import chunk, counts_displs, owner

PAIRS = [(n, s) for n in (0, 1, 2, 3, 5, 7, 10, 17, 100, 101, 1000, 4099) for s in (1, 2, 3, 4, 5, 7, 8, 16, 33)]


@pytest.mark.parametrize("n,size", PAIRS)
def test_chunks_tile_the_range_in_order(n, size):
    parts = [chunk(n, r, size) for r in range(size)]
    offset = 0
    for off, count in parts:
        assert off == offset and count >= 0
        offset += count
    assert offset == n
    counts = [c for _, c in parts]
    assert max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)      # the big parts come first
    assert counts_displs(n, size) == (counts, [o for o, _ in parts])


@pytest.mark.parametrize("n,size", [(n, s) for n, s in PAIRS if n])
def test_owner_inverts_chunk(n, size):
    for r in range(size):
        off, count = chunk(n, r, size)
        for i in {off, off + count - 1} if count else ():
            assert owner(i, n, size) == r


def test_fewer_elements_than_parts():
    assert [chunk(2, r, 4) for r in range(4)] == [(0, 1), (1, 1), (2, 0), (2, 0)]
    assert [chunk(0, r, 3) for r in range(3)] == [(0, 0)] * 3


def test_large_counts_are_exact():
    n = 2**40 + 12345
    size = 7
    parts = [chunk(n, r, size) for r in range(size)]
    assert sum(c for _, c in parts) == n
    assert parts[-1][0] + parts[-1][1] == n
    assert chunk(2**63 + 1, 1, 2) == (2**62 + 1, 2**62)


@pytest.mark.parametrize("args", [(-1, 0, 1), (5, 0, 0), (5, 3, 3), (5, -1, 3), (2.5, 0, 1)])
def test_bad_arguments_raise(args):
    with pytest.raises(ValueError):
        chunk(*args)
