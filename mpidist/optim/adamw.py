"""AdamW (Loshchilov & Hutter 2019), decoupled weight decay, as PyTorch documents it:

    m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g^2 ;  vmax = max(vmax, v)   (amsgrad)
    m_hat = m/(1-b1^t) ;  v_hat = v/(1-b2^t)  (vmax/(1-b2^t) with amsgrad; no
                                               correction with bias_correction=False)
    w = w - lr*wd*w - lr * m_hat/(sqrt(v_hat) + eps)

See docs/ARCHITECTURE.md (optimizers).
"""
from __future__ import annotations

import numpy as np

from mpidist.optim.base import Optimizer
from mpidist.optim.checks import check_adam_flags, check_betas, check_eps

__all__ = ["AdamW"]


class AdamW(Optimizer):
    """AdamW over a flat-buffer range. `exclude`: name patterns left out of weight decay."""

    name = "adamw"
    group_hyper = ("betas", "eps")
    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, layout, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, bias_correction=True, exclude=(), **kw):
        self.betas = check_betas(betas)
        self.eps = check_eps(eps)
        self.amsgrad, self.bias_correction = check_adam_flags(amsgrad, bias_correction)
        super().__init__(layout, lr=lr, weight_decay=weight_decay, exclude=exclude, **kw)

    def _active_states(self):
        return self.state_names + (("max_exp_avg_sq",) if self.amsgrad else ())

    def hyper(self):
        return {**super().hyper(), "betas": list(self.betas), "eps": self.eps,
                "amsgrad": self.amsgrad, "bias_correction": self.bias_correction}

    def corrections(self, t: int) -> tuple[float, float]:
        """(1 - b1^t, 1 - b2^t), or (1, 1) without bias correction."""
        b1, b2 = self.betas
        return (1.0 - b1 ** t, 1.0 - b2 ** t) if self.bias_correction else (1.0, 1.0)

    def _update(self, kern, work, g, gscale, lr, reduce_norms, finite):
        if not (kern.all_finite(g) if finite is None else finite):
            return self._skip("non-finite gradients")
        bc1, bc2 = self.corrections(self.step_count + 1)
        s = self._state
        vmax = s["max_exp_avg_sq"] if self.amsgrad else self._empty(work)
        seg_c = np.full(self.plan.nseg, float(lr))
        kern.adam_update(work, g, s["exp_avg"], s["exp_avg_sq"], vmax, self.seg_wd(), seg_c,
                         gscale, self.betas[0], self.betas[1], self.eps, bc1, bc2, self.amsgrad)
        return self._done(lr)
