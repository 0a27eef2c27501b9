"""Plain NumPy reference implementations of the four update rules, for the tests.

They follow the published rules as written in each optimizer's module docstring, one tensor
(segment) at a time, with the same arithmetic contract as the kernels: float64 per element,
states stored as float32, fp16/bf16 parameters updated through an fp32 master copy. A kernel
that agrees with these to rtol 1e-6 over many steps implements the rule.
"""
from __future__ import annotations

import numpy as np

__all__ = ["Reference", "sgd", "adamw", "lars", "lamb"]


def sgd(w, g, buf, t, *, lr, momentum, dampening, nesterov, wd):
    """One SGD step on float64 w, g (one tensor); buf float32 or None; returns new w."""
    d = g + wd * w
    if momentum > 0:
        b = d if t == 1 else momentum * buf.astype(np.float64) + (1.0 - dampening) * d
        buf[...] = b
        d = d + momentum * b if nesterov else b
    return w - lr * d


def _adam(g, m, v, vmax, t, betas, eps, bias_correction):
    """Moments after this step (stored into m, v, vmax) and the direction m_hat/(sqrt(v_hat)+eps)."""
    b1, b2 = betas
    bc1, bc2 = (1.0 - b1 ** t, 1.0 - b2 ** t) if bias_correction else (1.0, 1.0)
    m1 = b1 * m.astype(np.float64) + (1.0 - b1) * g
    v1 = b2 * v.astype(np.float64) + (1.0 - b2) * (g * g)
    m[...] = m1
    v[...] = v1
    if vmax is not None:
        v1 = np.maximum(vmax.astype(np.float64), v1)
        vmax[...] = v1
    return (m1 / bc1) / (np.sqrt(v1 / bc2) + eps)


def adamw(w, g, m, v, vmax, t, *, lr, betas, eps, wd, bias_correction=True):
    """One AdamW step (decoupled decay: w - lr*wd*w - lr*r)."""
    r = _adam(g, m, v, vmax, t, betas, eps, bias_correction)
    return w - lr * (r + wd * w)


def lars_trust(w, g, *, eta, wd):
    wn, gn = np.sqrt(np.sum(w * w)), np.sqrt(np.sum(g * g))
    return eta * wn / (gn + wd * wn) if wn > 0 and gn > 0 else 1.0


def lars(w, g, buf, *, lr, momentum, trust, wd):
    """One LARS step: v = momentum*v + lr*trust*(g + wd*w); w - v."""
    v = (lr * trust) * (g + wd * w)
    if momentum > 0:
        v = momentum * buf.astype(np.float64) + v
        buf[...] = v
    return w - v


def lamb(w, g, m, v, vmax, t, *, lr, betas, eps, wd, bias_correction, phi_clamp, trust_clamp,
         adapt=True):
    """One LAMB step; returns (new w, trust ratio)."""
    u = _adam(g, m, v, vmax, t, betas, eps, bias_correction) + wd * w
    wn, un = np.clip(np.sqrt(np.sum(w * w)), *phi_clamp), np.sqrt(np.sum(u * u))
    trust = float(np.clip(wn / un if wn > 0 and un > 0 else 1.0, *trust_clamp)) if adapt else 1.0
    return w - (lr * trust) * u, trust


class Reference:
    """The reference twin of an optimizer built over a whole layout: same hyperparameters,
    exclusions and parameter dtype, its own state. step() -> (skipped, trust ratios or None)."""

    def __init__(self, opt):
        if opt.offset != 0 or opt.count != opt.layout.numel:
            raise ValueError("the reference covers a whole layout; build the optimizer "
                             "without offset/count")
        self.name, self.hyper, self.layout = opt.name, opt.hyper(), opt.layout
        self.excluded = opt.excluded
        self.t = 0
        n = opt.layout.numel
        h = self.hyper
        self.state = {}
        if self.name in ("sgd", "lars") and h["momentum"] > 0:
            self.state["momentum_buffer"] = np.zeros(n, np.float32)
        if self.name in ("adamw", "lamb"):
            self.state["exp_avg"] = np.zeros(n, np.float32)
            self.state["exp_avg_sq"] = np.zeros(n, np.float32)
            if h["amsgrad"]:
                self.state["max_exp_avg_sq"] = np.zeros(n, np.float32)
        self.master = None

    def step(self, params, grads, loss_scale=1.0):
        g_all = grads.astype(np.float32).astype(np.float64) * (1.0 / loss_scale)
        if not np.isfinite(g_all).all():
            return True, None
        if params.dtype != np.float32 and self.master is None:
            self.master = params.astype(np.float32)
        target = params if self.master is None else self.master
        self.t += 1
        h, lr = self.hyper, self.hyper["lr"]
        trusts = np.ones(len(self.layout)) if self.name in ("lars", "lamb") else None
        for s in self.layout:
            sl = slice(s.offset, s.stop)
            w, g = target[sl].astype(np.float64), g_all[sl]
            st = {k: v[sl] for k, v in self.state.items()}
            wd = 0.0 if self.excluded[s.index] else h["weight_decay"]
            if self.name == "sgd":
                new = sgd(w, g, st.get("momentum_buffer"), self.t, lr=lr, momentum=h["momentum"],
                          dampening=h["dampening"], nesterov=h["nesterov"], wd=wd)
            elif self.name == "adamw":
                new = adamw(w, g, st["exp_avg"], st["exp_avg_sq"], st.get("max_exp_avg_sq"),
                            self.t, lr=lr, betas=h["betas"], eps=h["eps"], wd=wd,
                            bias_correction=h["bias_correction"])
            elif self.name == "lars":
                trust = 1.0 if self.excluded[s.index] else lars_trust(w, g, eta=h["eta"], wd=wd)
                new = lars(w, g, st.get("momentum_buffer"), lr=lr, momentum=h["momentum"],
                           trust=trust, wd=wd)
                trusts[s.index] = trust
            else:
                new, trusts[s.index] = lamb(
                    w, g, st["exp_avg"], st["exp_avg_sq"], st.get("max_exp_avg_sq"), self.t,
                    lr=lr, betas=h["betas"], eps=h["eps"], wd=wd,
                    bias_correction=h["bias_correction"], phi_clamp=h["phi_clamp"],
                    trust_clamp=h["trust_clamp"], adapt=not self.excluded[s.index])
            target[sl] = new
        if self.master is not None:
            params[...] = self.master.astype(params.dtype)
        return False, trusts
