"""SGD with momentum, dampening, Nesterov and weight decay, as PyTorch documents it:

    d = g + wd*w
    buf = d                               (first step)
    buf = momentum*buf + (1-dampening)*d  (later steps)
    d = d + momentum*buf  if nesterov else buf
    w = w - lr*d

See docs/ARCHITECTURE.md (optimizers).
"""
from __future__ import annotations

import numpy as np

from mpidist.optim.base import Optimizer
from mpidist.optim.checks import check_number

__all__ = ["SGD"]


class SGD(Optimizer):
    """Momentum SGD over a flat-buffer range. `exclude`: name patterns left out of decay."""

    name = "sgd"
    group_hyper = ("momentum", "dampening")

    def __init__(self, layout, lr=0.1, momentum=0.0, dampening=0.0, nesterov=False,
                 weight_decay=0.0, exclude=(), **kw):
        self.momentum = check_number("momentum", momentum, 0.0)
        self.dampening = check_number("dampening", dampening, 0.0, 1.0)
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")
        if nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov momentum needs momentum > 0 and dampening = 0")
        self.nesterov = nesterov
        super().__init__(layout, lr=lr, weight_decay=weight_decay, exclude=exclude, **kw)

    def _active_states(self):
        return ("momentum_buffer",) if self.momentum > 0 else ()

    def hyper(self):
        return {**super().hyper(), "momentum": self.momentum, "dampening": self.dampening,
                "nesterov": self.nesterov}

    def _update(self, kern, work, g, gscale, lr, reduce_norms, finite):
        if not (kern.all_finite(g) if finite is None else finite):
            return self._skip("non-finite gradients")
        use_buf = self.momentum > 0
        first = self.step_count == 0
        # buf = d on the first step, else momentum*buf + (1-dampening)*d
        decay = 0.0 if first else self.momentum
        c = 1.0 if first else 1.0 - self.dampening
        seg_c = np.full(self.plan.nseg, c)
        buf = self._state["momentum_buffer"] if use_buf else self._empty(work)
        kern.momentum_update(work, g, buf, self.seg_wd(), seg_c, gscale, decay, self.momentum,
                             float(lr), self.nesterov, use_buf)
        return self._done(lr)
