"""Checks of arguments at the public boundary that several packages share.

At the bottom of the import graph (standard library only), so any module may use them.
See docs/ARCHITECTURE.md (foundation).
"""
from __future__ import annotations

import numbers

__all__ = ["positive_int"]


def positive_int(name: str, value) -> int:
    """value as an int >= 1, else ValueError naming `name`.

    Takes Python and NumPy integers and their decimal text (an environment variable's
    value); not bools, floats or other text."""
    if isinstance(value, str):
        text = value.strip()
        n = int(text) if text.isdigit() else 0
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        n = int(value)
    else:
        n = 0
    if n < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return n
