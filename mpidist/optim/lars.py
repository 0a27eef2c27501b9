"""LARS (You, Gitman & Ginsburg 2017, "Large Batch Training of Convolutional Networks"),
layer-wise adaptive rate scaling with momentum, per tensor (segment) s:

    trust_s = eta*||w_s|| / (||g_s|| + wd*||w_s||)     (1 if either norm is 0)
    v = momentum*v + lr*trust_s*(g + wd*w)
    w = w - v
Tensors matching `exclude` (biases, norm parameters by default) get no decay and trust 1.
See docs/ARCHITECTURE.md (optimizers).
"""
from __future__ import annotations

import numpy as np

from mpidist.optim.base import DEFAULT_EXCLUDE, LayerwiseOptimizer
from mpidist.optim.checks import check_number

__all__ = ["LARS"]


class LARS(LayerwiseOptimizer):
    """LARS over a flat-buffer range; see the module docstring and base.LayerwiseOptimizer."""

    name = "lars"
    group_hyper = ("momentum", "eta")

    def __init__(self, layout, lr=1.0, momentum=0.9, eta=1e-3, weight_decay=5e-4,
                 exclude=DEFAULT_EXCLUDE, **kw):
        self.momentum = check_number("momentum", momentum, 0.0)
        self.eta = check_number("eta", eta, 0.0, lo_open=True)
        super().__init__(layout, lr=lr, weight_decay=weight_decay, exclude=exclude, **kw)

    def _active_states(self):
        return ("momentum_buffer",) if self.momentum > 0 else ()

    def hyper(self):
        return {**super().hyper(), "momentum": self.momentum, "eta": self.eta}

    def _sums(self, kern, work, g, gscale):
        return kern.sumsq_pg(work, g, gscale)          # columns: ||w||^2, ||g||^2

    def _trust(self, totals):
        wn, gn = np.sqrt(totals[:, 0]), np.sqrt(totals[:, 1])
        ok = (wn > 0) & (gn > 0)
        den = np.where(ok, gn + self.seg_wd() * wn, 1.0)
        return np.where(ok, self.eta * wn / den, 1.0)

    def _apply(self, kern, work, g, gscale, lr, trust):
        use_buf = self.momentum > 0
        buf = self._state["momentum_buffer"] if use_buf else self._empty(work)
        # v = momentum*v + (lr*trust_s)*(g + wd_s*w); w -= v
        kern.momentum_update(work, g, buf, self.seg_wd(), float(lr) * trust, gscale,
                             self.momentum, self.momentum, 1.0, False, use_buf)
