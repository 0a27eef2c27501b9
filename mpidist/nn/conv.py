"""2-D convolution by im2col (one matmul) and max/average pooling, NCHW layout.

See docs/ARCHITECTURE.md (layers).
"""
from __future__ import annotations

import math

from mpidist.checks import positive_int
from mpidist.kernels.backend import get_array_module
from mpidist.nn.module import Module

__all__ = ["Conv2d", "MaxPool2d", "AvgPool2d"]


def _out_size(n: int, k: int, stride: int, pad: int) -> int:
    out = (n + 2 * pad - k) // stride + 1
    if out < 1:
        raise ValueError(f"window {k} (stride {stride}, padding {pad}) does not fit input size {n}")
    return out


def _windows(x, k: int, stride: int, pad: int):
    """(N, C, H, W) -> (N, C, k, k, OH, OW): the input under each kernel offset (im2col)."""
    xp = get_array_module(x)
    n, c, h, w = x.shape
    oh, ow = _out_size(h, k, stride, pad), _out_size(w, k, stride, pad)
    if pad:
        x = xp.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    cols = xp.empty((n, c, k, k, oh, ow), dtype=x.dtype)
    for i in range(k):
        for j in range(k):
            cols[:, :, i, j] = x[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
    return cols


def _unwindow(dcols, shape, k: int, stride: int, pad: int):
    """Adjoint of _windows (col2im): scatter-add each offset's gradient back onto the input."""
    xp = get_array_module(dcols)
    n, c, h, w = shape
    oh, ow = dcols.shape[-2:]
    dx = xp.zeros((n, c, h + 2 * pad, w + 2 * pad), dtype=dcols.dtype)
    for i in range(k):
        for j in range(k):
            dx[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride] += dcols[:, :, i, j]
    return dx[:, :, pad:pad + h, pad:pad + w] if pad else dx


class Conv2d(Module):
    """Square-kernel convolution; weight (out, in, k, k), bias (out,)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0):
        super().__init__()
        self.cin = positive_int("in_channels", in_channels)
        self.cout = positive_int("out_channels", out_channels)
        self.k = positive_int("kernel_size", kernel_size)
        self.stride = positive_int("stride", stride)
        if padding < 0:
            raise ValueError(f"padding must be >= 0, got {padding}")
        self.pad = int(padding)
        self.add_param("weight", (self.cout, self.cin, self.k, self.k))
        self.add_param("bias", (self.cout,))

    def reset(self, rng):
        bound = 1.0 / math.sqrt(self.cin * self.k * self.k)
        self._set("weight", rng.uniform(-bound, bound, (self.cout, self.cin, self.k, self.k)))
        self._set("bias", rng.uniform(-bound, bound, self.cout))

    def forward(self, x, train=True):
        if x.ndim != 4 or x.shape[1] != self.cin:
            raise ValueError(f"Conv2d expects (N, {self.cin}, H, W), got {x.shape}")
        xp = get_array_module(x)
        self._shape = x.shape
        cols = _windows(x, self.k, self.stride, self.pad)          # (N, C, k, k, OH, OW)
        n, _, _, _, oh, ow = cols.shape
        # rows = (C, k, k) patch, columns = every output pixel of every sample
        self._cols = cols.reshape(n, -1, oh * ow).transpose(1, 0, 2).reshape(-1, n * oh * ow)
        w2 = self.p["weight"].reshape(self.cout, -1)
        y = (w2 @ self._cols).reshape(self.cout, n, oh, ow) + self.p["bias"].reshape(-1, 1, 1, 1)
        return xp.ascontiguousarray(y.transpose(1, 0, 2, 3))

    def backward(self, dy):
        n, _, oh, ow = dy.shape
        dy2 = dy.transpose(1, 0, 2, 3).reshape(self.cout, -1)       # (out, N*OH*OW)
        self.g["weight"] += (dy2 @ self._cols.T).reshape(self.g["weight"].shape)
        self.g["bias"] += dy2.sum(axis=1)
        if not self.input_grad:
            self._cols = None
            self._grads_ready()
            return None
        dcols = self.p["weight"].reshape(self.cout, -1).T @ dy2      # (C*k*k, N*OH*OW)
        dcols = dcols.reshape(-1, n, oh * ow).transpose(1, 0, 2).reshape(n, self.cin, self.k, self.k, oh, ow)
        self._cols = None
        self._grads_ready()
        return _unwindow(dcols, self._shape, self.k, self.stride, self.pad)


class MaxPool2d(Module):
    """Max over k x k windows (stride defaults to k); the gradient goes to the first maximum."""

    def __init__(self, kernel_size: int, stride: int | None = None):
        super().__init__()
        self.k = positive_int("kernel_size", kernel_size)
        self.stride = positive_int("stride", stride if stride is not None else kernel_size)

    def forward(self, x, train=True):
        xp = get_array_module(x)
        self._shape = x.shape
        cols = _windows(x, self.k, self.stride, 0)
        n, c, k, _, oh, ow = cols.shape
        flat = cols.reshape(n, c, k * k, oh, ow)
        self._arg = xp.argmax(flat, axis=2)
        return xp.take_along_axis(flat, self._arg[:, :, None], axis=2)[:, :, 0]

    def backward(self, dy):
        xp = get_array_module(dy)
        n, c, oh, ow = dy.shape
        k = self.k
        dcols = (xp.arange(k * k).reshape(1, 1, -1, 1, 1) == self._arg[:, :, None]) * dy[:, :, None]
        return _unwindow(dcols.reshape(n, c, k, k, oh, ow), self._shape, k, self.stride, 0)


class AvgPool2d(Module):
    """Mean over k x k windows (stride defaults to k)."""

    def __init__(self, kernel_size: int, stride: int | None = None):
        super().__init__()
        self.k = positive_int("kernel_size", kernel_size)
        self.stride = positive_int("stride", stride if stride is not None else kernel_size)

    def forward(self, x, train=True):
        self._shape = x.shape
        return _windows(x, self.k, self.stride, 0).mean(axis=(2, 3))

    def backward(self, dy):
        xp = get_array_module(dy)
        n, c, oh, ow = dy.shape
        dcols = xp.broadcast_to((dy / (self.k * self.k))[:, :, None, None], (n, c, self.k, self.k, oh, ow))
        return _unwindow(dcols, self._shape, self.k, self.stride, 0)
