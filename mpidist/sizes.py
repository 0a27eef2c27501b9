"""Byte sizes as people write them: '64K' <-> 65536, for the command lines and the
allreduce decision table; and lists of counts, '2,4' -> [2, 4], for the command lines.
See docs/ARCHITECTURE.md (foundation)."""
from __future__ import annotations

import argparse

__all__ = ["parse_size", "parse_sizes", "format_size", "positive_ints"]

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text) -> int:
    """'64K' -> 65536; also '1M', '2G', '64KiB', '1.5K', '512' and plain ints (bytes).

    Raises argparse.ArgumentTypeError naming the text otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    mult = _UNITS.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512, 64K, 1M)") from None


def parse_sizes(text: str) -> list[int]:
    """'4K,1M,64M' -> bytes (an argparse type: a bad entry is a clean usage error)."""
    return [parse_size(s) for s in text.split(",") if s.strip()]


def format_size(n: int) -> str:
    """65536 -> '64K'; sizes that are not whole K/M/G stay in bytes."""
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def positive_ints(text: str) -> list[int]:
    """'2,4' -> [2, 4]: comma-separated integers >= 1 (an argparse type).

    Raises argparse.ArgumentTypeError naming the text otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
