"""The wire format of a compressed payload: one uint8 message holding the payload's arrays,
their int64 element counts first, then each array's bytes padded to 8, so that after a
receive every array is viewed in place at its own alignment.

    msg = pack((values, indices)); values, indices = unpack(msg, (np.float32, np.int32))
"""
from __future__ import annotations

import numpy as np

from mpidist.kernels.backend import to_numpy

__all__ = ["pack", "unpack"]


def _pad8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def pack(payload) -> np.ndarray:
    """One uint8 message: int64 element counts, then each array's bytes padded to 8."""
    arrays = [np.ascontiguousarray(to_numpy(a)).reshape(-1) for a in payload]
    out = np.zeros(8 * len(arrays) + sum(_pad8(a.nbytes) for a in arrays), dtype=np.uint8)
    out[:8 * len(arrays)].view(np.int64)[:] = [a.size for a in arrays]
    off = 8 * len(arrays)
    for a in arrays:
        out[off:off + a.nbytes] = a.view(np.uint8)
        off += _pad8(a.nbytes)
    return out


def unpack(buf: np.ndarray, dtypes) -> tuple:
    """The arrays of a pack()ed message (aligned views into buf)."""
    m = len(dtypes)
    counts = buf[:8 * m].view(np.int64)
    off, out = 8 * m, []
    for count, dt in zip(counts, dtypes):
        nbytes = int(count) * np.dtype(dt).itemsize
        out.append(buf[off:off + nbytes].view(dt))
        off += _pad8(nbytes)
    return tuple(out)
