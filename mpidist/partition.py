"""The one partition of n elements over `size` parts, used by reduce-scatter segments,
ZeRO shards, parameter-server shards and checkpoint slices alike.

Pure Python integers, so any n (also > 2**63 in principle) partitions exactly.
"""

import operator

__all__ = ["chunk", "counts_displs", "owner", "pieces"]


def _int(value, what: str) -> int:
    """An exact integer (NumPy integers too); floats and bools are refused."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


def _check(n: int, size: int) -> tuple[int, int]:
    n, size = _int(n, "n"), _int(size, "size")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if size < 1:
        raise ValueError(f"size must be positive, got {size}")
    return n, size


def chunk(n: int, rank: int, size: int) -> tuple[int, int]:
    """(offset, count) of part `rank`: the first n % size parts hold one element more."""
    n, size = _check(n, size)
    rank = _int(rank, "rank")
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    base, extra = divmod(n, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def counts_displs(n: int, size: int) -> tuple[list[int], list[int]]:
    """Counts and displacements of every part, as MPI's v-collectives take them."""
    parts = [chunk(n, r, size) for r in range(_check(n, size)[1])]
    return [c for _, c in parts], [o for o, _ in parts]


def owner(index: int, n: int, size: int) -> int:
    """The part that holds element `index` under chunk(n, ., size)."""
    n, size = _check(n, size)
    index = _int(index, "index")
    if not 0 <= index < n:
        raise ValueError(f"index must be in [0, {n}), got {index}")
    base, extra = divmod(n, size)
    big = extra * (base + 1)
    return index // (base + 1) if index < big else extra + (index - big) // base


def pieces(lo: int, hi: int, n: int, size: int) -> list[tuple[int, int]]:
    """(start relative to lo, count) of [lo, hi) ∩ chunk(n, r, size) for every part r: the
    piece of a range each part holds (count 0 where none); they tile [0, hi - lo) in order."""
    counts, displs = counts_displs(n, size)
    out = []
    for offset, count in zip(displs, counts):
        a, b = max(lo, offset), min(hi, offset + count)
        out.append((min(a, hi) - lo, max(0, b - a)))
    return out
