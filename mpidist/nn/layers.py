"""Elementwise and dense layers, each with a hand-written backward on the input's array module.

See docs/ARCHITECTURE.md (layers).
"""
from __future__ import annotations

import math

import numpy as np

from mpidist.checks import positive_int
from mpidist.kernels.backend import get_array_module
from mpidist.nn.module import Module

__all__ = ["Linear", "ReLU", "GELU", "LayerNorm", "Dropout", "Flatten", "Embedding"]


class Linear(Module):
    """y = x @ W + b over the last axis of x (any leading shape). W has shape (in, out)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, init_std: float | None = None):
        super().__init__()
        self.in_features = positive_int("in_features", in_features)
        self.out_features = positive_int("out_features", out_features)
        self.has_bias = bool(bias)
        self.init_std = init_std
        self.add_param("weight", (self.in_features, self.out_features))
        if self.has_bias:
            self.add_param("bias", (self.out_features,))

    def reset(self, rng):
        shape = (self.in_features, self.out_features)
        if self.init_std is None:            # uniform +-1/sqrt(fan_in), as common frameworks do
            bound = 1.0 / math.sqrt(self.in_features)
            self._set("weight", rng.uniform(-bound, bound, shape))
            if self.has_bias:
                self._set("bias", rng.uniform(-bound, bound, self.out_features))
        else:
            self._set("weight", rng.normal(0.0, self.init_std, shape))
            if self.has_bias:
                self._set("bias", np.zeros(self.out_features))

    def forward(self, x, train=True):
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Linear expects last axis {self.in_features}, got input shape {x.shape}")
        self._x = x
        y = x @ self.p["weight"]
        if self.has_bias:
            y += self.p["bias"]
        return y

    def backward(self, dy):
        x2 = self._x.reshape(-1, self.in_features)
        dy2 = dy.reshape(-1, self.out_features)
        self.g["weight"] += x2.T @ dy2
        if self.has_bias:
            self.g["bias"] += dy2.sum(axis=0)
        dx = dy @ self.p["weight"].T if self.input_grad else None
        self._x = None
        self._grads_ready()
        return dx


class ReLU(Module):
    """max(x, 0)."""
    def forward(self, x, train=True):
        self._mask = x > 0
        return x * self._mask

    def backward(self, dy):
        return dy * self._mask


class GELU(Module):
    """tanh approximation: 0.5 x (1 + tanh(c (x + 0.044715 x^3))), c = sqrt(2/pi)."""
    _C = math.sqrt(2.0 / math.pi)

    def forward(self, x, train=True):
        xp = get_array_module(x)
        self._x = x
        self._t = xp.tanh(self._C * (x + 0.044715 * (x * x * x)))
        return 0.5 * x * (1.0 + self._t)

    def backward(self, dy):
        x, t = self._x, self._t
        dt = (1.0 - t * t) * self._C * (1.0 + 3 * 0.044715 * x * x)
        return dy * (0.5 * (1.0 + t) + 0.5 * x * dt)


class LayerNorm(Module):
    """Normalise the last axis to zero mean and unit variance, then scale and shift."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim = positive_int("dim", dim)
        self.eps = float(eps)
        self.add_param("weight", (self.dim,))
        self.add_param("bias", (self.dim,))

    def reset(self, rng):
        self._set("weight", np.ones(self.dim))
        self._set("bias", np.zeros(self.dim))

    def forward(self, x, train=True):
        xp = get_array_module(x)
        mu = x.mean(axis=-1, keepdims=True)
        xc = x - mu
        rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + self.eps)
        self._xhat, self._rstd = xc * rstd, rstd
        return self._xhat * self.p["weight"] + self.p["bias"]

    def backward(self, dy):
        xhat, rstd = self._xhat, self._rstd
        d = self.dim
        self.g["weight"] += (dy * xhat).reshape(-1, d).sum(axis=0)
        self.g["bias"] += dy.reshape(-1, d).sum(axis=0)
        dxhat = dy * self.p["weight"]
        # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                     - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
        self._xhat = self._rstd = None
        self._grads_ready()
        return dx


class Dropout(Module):
    """Zero each input with probability p in training (inverted scaling); identity in eval.

    The mask comes from a NumPy generator seeded at construction, so runs repeat exactly.
    """

    def __init__(self, p: float = 0.1, seed: int = 0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout p must be in [0, 1), got {p!r}")
        self.prob = float(p)
        self._rng = np.random.default_rng(seed)

    def forward(self, x, train=True):
        if not train or self.prob == 0.0:
            self._mask = None
            return x
        xp = get_array_module(x)
        keep = self._rng.random(x.shape) >= self.prob
        self._mask = xp.asarray(keep, dtype=x.dtype) / (1.0 - self.prob)
        return x * self._mask

    def backward(self, dy):
        return dy if self._mask is None else dy * self._mask


class Flatten(Module):
    """(N, ...) -> (N, prod(...))."""

    def forward(self, x, train=True):
        self._shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy):
        return dy.reshape(self._shape)


class Embedding(Module):
    """Integer ids (any shape) -> rows of a (num, dim) table. Returns no input gradient."""

    def __init__(self, num: int, dim: int, init_std: float = 0.02):
        super().__init__()
        self.num = positive_int("num", num)
        self.dim = positive_int("dim", dim)
        self.init_std = float(init_std)
        self.add_param("weight", (self.num, self.dim))

    def reset(self, rng):
        self._set("weight", rng.normal(0.0, self.init_std, (self.num, self.dim)))

    def forward(self, ids, train=True):
        xp = get_array_module(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"Embedding takes integer ids, got dtype {ids.dtype}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num):
            raise ValueError(f"Embedding ids must lie in [0, {self.num})")
        self._ids = xp.asarray(ids)
        return self.p["weight"][self._ids]

    def backward(self, dy):
        xp = get_array_module(dy)
        if xp is np:
            np.add.at(self.g["weight"], self._ids.reshape(-1), dy.reshape(-1, self.dim))
        else:                                  # CuPy's scatter-add (atomic adds on the device)
            import cupyx                       # optional: dy is a CuPy array
            cupyx.scatter_add(self.g["weight"], self._ids.reshape(-1), dy.reshape(-1, self.dim))
        self._ids = None
        self._grads_ready()
        return None
