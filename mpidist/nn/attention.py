"""Causal multi-head self-attention with a hand-written backward.

See docs/ARCHITECTURE.md (layers).
"""
from __future__ import annotations

import math

from mpidist.checks import positive_int
from mpidist.kernels.backend import get_array_module
from mpidist.nn.layers import Linear
from mpidist.nn.module import Module

__all__ = ["CausalSelfAttention"]


class CausalSelfAttention(Module):
    """(B, T, C) -> (B, T, C); each position attends to itself and earlier positions only."""

    def __init__(self, dim: int, heads: int, init_std: float = 0.02):
        super().__init__()
        self.dim = positive_int("dim", dim)
        self.heads = positive_int("heads", heads)
        if self.dim % self.heads:
            raise ValueError(f"attention dim {dim} must be divisible by heads {heads}")
        self.qkv = self.add_child("qkv", Linear(self.dim, 3 * self.dim, init_std=init_std))
        self.proj = self.add_child("proj", Linear(self.dim, self.dim, init_std=init_std))

    def _split(self, t, b, n):       # (B, T, C) -> (B, H, T, D)
        return t.reshape(b, n, self.heads, -1).transpose(0, 2, 1, 3)

    def forward(self, x, train=True):
        xp = get_array_module(x)
        b, n, c = x.shape
        qkv = self.qkv.forward(x, train)
        q, k, v = (self._split(qkv[..., i * c:(i + 1) * c], b, n) for i in range(3))
        scale = 1.0 / math.sqrt(c // self.heads)
        s = (q @ k.transpose(0, 1, 3, 2)) * scale                     # (B, H, T, T)
        future = xp.triu(xp.ones((n, n), dtype=bool), k=1)
        s = xp.where(future, -xp.inf, s)
        s = s - s.max(axis=-1, keepdims=True)
        a = xp.exp(s)
        a /= a.sum(axis=-1, keepdims=True)
        o = a @ v                                                      # (B, H, T, D)
        self._cache = (q, k, v, a, scale, b, n, c)
        return self.proj.forward(o.transpose(0, 2, 1, 3).reshape(b, n, c), train)

    def backward(self, dy):
        xp = get_array_module(dy)
        q, k, v, a, scale, b, n, c = self._cache
        do = self._split(self.proj.backward(dy), b, n)
        da = do @ v.transpose(0, 1, 3, 2)
        dv = a.transpose(0, 1, 3, 2) @ do
        ds = a * (da - (da * a).sum(axis=-1, keepdims=True)) * scale   # softmax backward
        dq = ds @ k
        dk = ds.transpose(0, 1, 3, 2) @ q
        merge = [t.transpose(0, 2, 1, 3).reshape(b, n, c) for t in (dq, dk, dv)]
        self._cache = None
        return self.qkv.backward(xp.concatenate(merge, axis=-1))
