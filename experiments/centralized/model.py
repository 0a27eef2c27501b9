"""The bandwidth model of the saving: a ring against one parameter server."""
from __future__ import annotations


def model_reduction(p: int) -> float:
    """1 - ring time / one-server time under the bandwidth model: ring 2 (p-1) n / p,
    one server 2 p n (push, then pull, through its one link)."""
    return 1 - (2 * (p - 1) / p) / (2 * p)
