"""Softmax cross-entropy over the last axis, returning a SUM so callers choose the normaliser.

See docs/ARCHITECTURE.md (layers).
"""
from __future__ import annotations

from mpidist.kernels.backend import get_array_module

__all__ = ["SoftmaxCrossEntropy"]


class SoftmaxCrossEntropy:
    """forward(logits, targets) -> (loss summed over samples, number correct).

    backward(scale) returns d(scale * loss_sum)/d logits. Data-parallel training passes
    scale = 1 / global batch size and SUMS gradients across ranks: that is the gradient of
    the global mean loss even when ranks hold unequal numbers of samples.
    """

    def forward(self, logits, targets):
        xp = get_array_module(logits)
        c = logits.shape[-1]
        z = logits.reshape(-1, c)
        t = xp.asarray(targets).reshape(-1)
        if t.shape[0] != z.shape[0]:
            raise ValueError(f"cross-entropy: {z.shape[0]} predictions but {t.shape[0]} targets")
        z = z - z.max(axis=1, keepdims=True)
        e = xp.exp(z)
        s = e.sum(axis=1, keepdims=True)
        rows = xp.arange(z.shape[0])
        loss = float((xp.log(s[:, 0]) - z[rows, t]).sum())
        correct = int((z.argmax(axis=1) == t).sum())
        self._p, self._t, self._shape = e / s, t, logits.shape
        return loss, correct

    def backward(self, scale: float = 1.0):
        xp = get_array_module(self._p)
        d = self._p.copy()
        d[xp.arange(d.shape[0]), self._t] -= 1.0
        d *= scale
        self._p = self._t = None
        return d.reshape(self._shape)
