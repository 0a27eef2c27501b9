"""How the compressed ring (mpidist.compress.ring) carries a chunk: encode(lo, data) makes
the message, add(msg, out) adds its values into out, set(msg, out) overwrites out with
them. RawCodec sends float32 as it is (warm-up, and the sums of linear compressors);
CompressorCodec sends a compressor's packed payload, re-encoding partial sums at each hop.
"""
from __future__ import annotations

import numpy as np

from mpidist.compress.base import Compressor
from mpidist.compress.wire import pack, unpack

__all__ = ["RawCodec", "CompressorCodec"]


class RawCodec:
    """float32 chunks as they are (the uncompressed ring)."""

    @staticmethod
    def encode(lo: int, chunk: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(chunk).view(np.uint8)

    @staticmethod
    def add(msg: np.ndarray, out: np.ndarray) -> None:
        out += msg.view(np.float32)

    @staticmethod
    def set(msg: np.ndarray, out: np.ndarray) -> None:
        out[...] = msg.view(np.float32)


class CompressorCodec:
    """Chunks as a compressor's packed payload. With error feedback, what each encoding
    drops (data - decoded) is added to `err` at the chunk's positions, so the rank that
    encoded keeps it."""

    def __init__(self, c: Compressor, err):
        self.c, self.err = c, err
        self.dtypes = [a.dtype for a in c.encode(np.zeros(0, np.float32), None)[0]]

    def encode(self, lo: int, data: np.ndarray) -> np.ndarray:
        msg = pack(self.c.encode(np.ascontiguousarray(data), None)[0])
        if self.err is not None:
            e = self.err[lo:lo + data.shape[0]]
            e += data
            e -= self.c.decompress(unpack(msg, self.dtypes), {"n": data.shape[0]})
        return msg

    def add(self, msg: np.ndarray, out: np.ndarray) -> None:
        self.c.decode_add(unpack(msg, self.dtypes), {"n": out.shape[0]}, out)

    def set(self, msg: np.ndarray, out: np.ndarray) -> None:
        out[...] = 0
        self.add(msg, out)
