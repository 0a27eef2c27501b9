"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", Algorithm 2), per tensor (segment) s:

    m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g^2
    m_hat = m/(1-b1^t) ;  v_hat = v/(1-b2^t)            (bias_correction=False: no division)
    r = m_hat/(sqrt(v_hat) + eps) + wd*w
    trust_s = phi(||w_s||) / ||r_s||   (1 if either is 0), phi(z) = min(max(z, lo), hi)
    trust_s = min(max(trust_s, trust_lo), trust_hi)
    w = w - lr*trust_s*r
phi_clamp=(0, inf) is the identity; the LAMB paper's gamma_l, gamma_u are phi_clamp.
Tensors matching `exclude` (biases, norm parameters by default) get no decay and trust 1.
See docs/ARCHITECTURE.md (optimizers).
"""
from __future__ import annotations

import numpy as np

from mpidist.optim.base import DEFAULT_EXCLUDE, LayerwiseOptimizer
from mpidist.optim.checks import check_adam_flags, check_betas, check_eps, check_number

__all__ = ["LAMB"]


def _clamp_pair(name, pair):
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{name} must be a pair (lo, hi), got {pair!r}")
    lo = check_number(f"{name}[0]", pair[0], 0.0, np.inf)
    hi = check_number(f"{name}[1]", pair[1], 0.0, np.inf)
    if hi < lo or hi == 0:
        raise ValueError(f"{name} must have 0 <= lo <= hi and hi > 0, got {pair!r}")
    return lo, hi


class LAMB(LayerwiseOptimizer):
    """LAMB over a flat-buffer range; see the module docstring and base.LayerwiseOptimizer.

    Two passes: phase 1 reads w, g, m, v and sums ||w||^2, ||r||^2, ||g||^2 per segment
    (nothing written, so a skipped step leaves the moments as they were); phase 2 recomputes
    r and writes w, m, v.
    """

    name = "lamb"
    group_hyper = ("betas", "eps")
    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, layout, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=1e-2,
                 bias_correction=True, amsgrad=False, phi_clamp=(0.0, np.inf),
                 trust_clamp=(0.0, np.inf), exclude=DEFAULT_EXCLUDE, **kw):
        self.betas = check_betas(betas)
        self.eps = check_eps(eps)
        self.amsgrad, self.bias_correction = check_adam_flags(amsgrad, bias_correction)
        self.phi_clamp = _clamp_pair("phi_clamp", phi_clamp)
        self.trust_clamp = _clamp_pair("trust_clamp", trust_clamp)
        super().__init__(layout, lr=lr, weight_decay=weight_decay, exclude=exclude, **kw)

    def _active_states(self):
        return self.state_names + (("max_exp_avg_sq",) if self.amsgrad else ())

    def hyper(self):
        return {**super().hyper(), "betas": list(self.betas), "eps": self.eps,
                "bias_correction": self.bias_correction, "amsgrad": self.amsgrad,
                "phi_clamp": list(self.phi_clamp), "trust_clamp": list(self.trust_clamp)}

    def corrections(self, t: int) -> tuple[float, float]:
        """(1 - b1^t, 1 - b2^t), or (1, 1) without bias correction."""
        b1, b2 = self.betas
        return (1.0 - b1 ** t, 1.0 - b2 ** t) if self.bias_correction else (1.0, 1.0)

    def _moments(self):
        s = self._state
        vmax = s["max_exp_avg_sq"] if self.amsgrad else self._empty(s["exp_avg"])
        bc1, bc2 = self.corrections(self.step_count + 1)
        return (s["exp_avg"], s["exp_avg_sq"], vmax, self.betas[0], self.betas[1], self.eps,
                bc1, bc2, self.amsgrad)

    def _sums(self, kern, work, g, gscale):
        m, v, vmax, b1, b2, eps, bc1, bc2, ams = self._moments()
        # columns: ||w||^2, ||r||^2, ||g||^2
        return kern.lamb_sums(work, g, m, v, vmax, self.seg_wd(), gscale, b1, b2, eps, bc1,
                              bc2, ams)

    def _trust(self, totals):
        wn = np.clip(np.sqrt(totals[:, 0]), *self.phi_clamp)
        rn = np.sqrt(totals[:, 1])
        ok = (wn > 0) & (rn > 0)
        ratio = np.where(ok, wn / np.where(ok, rn, 1.0), 1.0)
        return np.clip(ratio, *self.trust_clamp)

    def _apply(self, kern, work, g, gscale, lr, trust):
        m, v, vmax, b1, b2, eps, bc1, bc2, ams = self._moments()
        # w -= (lr*trust_s) * (r + wd_s*w)
        kern.adam_update(work, g, m, v, vmax, self.seg_wd(), float(lr) * trust, gscale, b1, b2,
                         eps, bc1, bc2, ams)
