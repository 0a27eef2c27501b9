"""CRC-32 of a global tensor from the CRCs of its pieces.

Every rank checksums only the bytes it writes (or reads); the pieces' CRCs are combined in
order into the CRC-32 of the whole tensor's bytes, the same number zlib.crc32 gives over the
concatenation. So the checksum does not depend on how many ranks wrote the file, and a
reader at another world size verifies it from its own pieces.

Combining uses the linearity of CRC over GF(2): appending n zero bytes to a message is a
32x32 bit-matrix applied to its CRC, and the matrices for n = 2**k bytes are squares of one
another, built once and cached.
"""
from __future__ import annotations

import zlib

__all__ = ["crc32", "crc32_combine", "combine_pieces"]

_POLY = 0xEDB88320          # CRC-32 (IEEE 802.3), reflected
_ZEROS: list[list[int]] = []  # _ZEROS[k]: operator "append 2**k zero bytes" as 32 column vectors


def crc32(data, value: int = 0) -> int:
    """zlib's CRC-32 of a bytes-like object (a C-contiguous NumPy array works), chained from value."""
    return zlib.crc32(data, value) & 0xFFFFFFFF


def _times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, mat[i]) for i in range(32)]


def _zeros_operator(k: int) -> list[int]:
    """The operator that appends 2**k zero bytes (built by squaring, cached)."""
    if not _ZEROS:
        one_bit = [_POLY] + [1 << i for i in range(31)]   # append one zero bit
        op = one_bit
        for _ in range(3):                                 # 1 bit -> 8 bits = 1 byte
            op = _square(op)
        _ZEROS.append(op)
    while len(_ZEROS) <= k:
        _ZEROS.append(_square(_ZEROS[-1]))
    return _ZEROS[k]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc32(A), crc32(B) and len(B) in bytes."""
    if len2 < 0:
        raise ValueError(f"len2 must be >= 0, got {len2}")
    crc1 &= 0xFFFFFFFF
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_zeros_operator(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ (crc2 & 0xFFFFFFFF)


def combine_pieces(pieces, itemsize: int, numel: int) -> int:
    """CRC-32 of a whole tensor from (offset, count, crc) pieces, offsets and counts in elements.

    The pieces must tile [0, numel) exactly (in any order); ValueError names the gap or overlap.
    """
    total, pos = 0, 0
    for offset, count, value in sorted(pieces):
        if count == 0:
            continue
        if offset != pos:
            kind = "gap" if offset > pos else "overlap"
            raise ValueError(f"pieces do not tile the tensor: {kind} at element {min(pos, offset)}")
        total = crc32_combine(total, value, count * itemsize)
        pos += count
    if pos != numel:
        raise ValueError(f"pieces cover {pos} of {numel} elements")
    return total
