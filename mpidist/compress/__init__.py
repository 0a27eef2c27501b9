"""Gradient compression: compressors by name, and the compressed allreduce.

    from mpidist.compress import make_compressor, CompressedAllreduce
    ca = CompressedAllreduce(make_compressor("topk", ratio=0.01), comm)
    avg = ca(grad_flat, layout)          # the average over ranks, same shape and dtype
    ca.bytes_sent                        # exact bytes this rank sent in that call
"""
from __future__ import annotations

import inspect

from mpidist.compress.allreduce import CompressedAllreduce
from mpidist.compress.base import Compressor
from mpidist.compress.fp16 import BF16, FP16
from mpidist.compress.momentum import MomentumAllreduce
from mpidist.compress.powersgd import PowerSGD
from mpidist.compress.qsgd import QSGD
from mpidist.compress.randomk import RandomK
from mpidist.compress.sign import Sign
from mpidist.compress.topk import TopK

__all__ = ["make_compressor", "compressor_names", "COMPRESSORS",
           "Compressor", "CompressedAllreduce", "MomentumAllreduce", "FP16", "BF16", "TopK", "RandomK", "Sign",
           "QSGD", "PowerSGD"]

COMPRESSORS = {cls.name: cls for cls in (FP16, BF16, TopK, RandomK, Sign, QSGD, PowerSGD)}


def compressor_names() -> list[str]:
    return sorted(COMPRESSORS)


def make_compressor(name: str, **options) -> Compressor:
    """A new compressor by name with its options, e.g. make_compressor("qsgd", levels=7)."""
    if isinstance(name, Compressor):
        if options:
            raise ValueError("options go to make_compressor with a name, not an instance")
        return name
    cls = COMPRESSORS.get(name)
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}; valid names: "
                         f"{', '.join(compressor_names())}")
    try:
        return cls(**options)
    except TypeError as exc:
        if "unexpected keyword" not in str(exc):
            raise
        valid = [p for p in inspect.signature(cls).parameters]
        raise ValueError(f"compressor {name!r} takes options {', '.join(valid)}; "
                         f"got {', '.join(sorted(options))}") from None

