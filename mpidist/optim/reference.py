"""Plain NumPy reference implementations of the four update rules, for the tests.

They follow the published rules as written in each optimizer's module docstring, one tensor
(segment) at a time, with the same arithmetic contract as the kernels: float32 element-wise
(hyperparameters rounded to float32 once), sums of squares in float64, fp16/bf16 parameters
updated through an fp32 master copy. A kernel that agrees with these to rtol 1e-6 over many
steps implements the rule.
See docs/ARCHITECTURE.md (optimizers).
"""
from __future__ import annotations

import numpy as np

__all__ = ["Reference", "sgd", "adamw", "lars", "lamb", "sumsq"]

f32 = np.float32


def sumsq(x) -> float:
    """The sum of squares of x, accumulated in float64."""
    return float(np.sum(np.square(x.astype(np.float64))))


def sgd(w, g, buf, t, *, lr, momentum, dampening, nesterov, wd):
    """One SGD step on float32 w, g (one tensor, updated in place); buf float32 or None."""
    d = g + f32(wd) * w
    if momentum > 0:
        if t == 1:
            buf[...] = d
        else:
            buf[...] = f32(momentum) * buf + f32(1.0 - dampening) * d
        d = d + f32(momentum) * buf if nesterov else buf
    w -= f32(lr) * d


def _adam(g, m, v, vmax, t, betas, eps, bias_correction):
    """Update m, v (and vmax) in place; return the direction m_hat/(sqrt(v_hat) + eps)."""
    b1, b2 = betas
    bc1, bc2 = (1.0 - b1 ** t, 1.0 - b2 ** t) if bias_correction else (1.0, 1.0)
    m[...] = f32(b1) * m + f32(1.0 - b1) * g
    v[...] = f32(b2) * v + f32(1.0 - b2) * (g * g)
    vm = v
    if vmax is not None:
        vmax[...] = np.maximum(vmax, v)
        vm = vmax
    return (m / f32(bc1)) / (np.sqrt(vm / f32(bc2)) + f32(eps))


def adamw(w, g, m, v, vmax, t, *, lr, betas, eps, wd, bias_correction=True):
    """One AdamW step (decoupled decay: w - lr*wd*w - lr*r), in place."""
    r = _adam(g, m, v, vmax, t, betas, eps, bias_correction)
    w -= f32(lr) * (r + f32(wd) * w)


def lars_trust(w, g, *, eta, wd) -> float:
    """LARS's trust ratio eta ||w|| / (||g|| + wd ||w||), 1 where either norm is 0."""
    wn, gn = np.sqrt(sumsq(w)), np.sqrt(sumsq(g))
    return eta * wn / (gn + wd * wn) if wn > 0 and gn > 0 else 1.0


def lars(w, g, buf, *, lr, momentum, trust, wd):
    """One LARS step in place: v = momentum*v + lr*trust*(g + wd*w); w - v."""
    d = g + f32(wd) * w
    if momentum > 0:
        buf[...] = f32(momentum) * buf + f32(lr * trust) * d
        w -= buf
    else:
        w -= f32(1.0) * (f32(lr * trust) * d)


def lamb(w, g, m, v, vmax, t, *, lr, betas, eps, wd, bias_correction, phi_clamp, trust_clamp,
         adapt=True) -> float:
    """One LAMB step in place; returns the trust ratio."""
    u = _adam(g, m, v, vmax, t, betas, eps, bias_correction) + f32(wd) * w
    wn, un = np.clip(np.sqrt(sumsq(w)), *phi_clamp), np.sqrt(sumsq(u))
    trust = float(np.clip(wn / un if wn > 0 and un > 0 else 1.0, *trust_clamp)) if adapt else 1.0
    w -= f32(lr * trust) * u
    return trust


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
        g_all = grads.astype(np.float32) * f32(1.0 / loss_scale)
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
            w, g = target[sl], g_all[sl]
            st = {k: v[sl] for k, v in self.state.items()}
            wd = 0.0 if self.excluded[s.index] else h["weight_decay"]
            if self.name == "sgd":
                sgd(w, g, st.get("momentum_buffer"), self.t, lr=lr, momentum=h["momentum"],
                          dampening=h["dampening"], nesterov=h["nesterov"], wd=wd)
            elif self.name == "adamw":
                adamw(w, g, st["exp_avg"], st["exp_avg_sq"], st.get("max_exp_avg_sq"),
                            self.t, lr=lr, betas=h["betas"], eps=h["eps"], wd=wd,
                            bias_correction=h["bias_correction"])
            elif self.name == "lars":
                trust = 1.0 if self.excluded[s.index] else lars_trust(w, g, eta=h["eta"], wd=wd)
                lars(w, g, st.get("momentum_buffer"), lr=lr, momentum=h["momentum"],
                           trust=trust, wd=wd)
                trusts[s.index] = trust
            else:
                trusts[s.index] = lamb(
                    w, g, st["exp_avg"], st["exp_avg_sq"], st.get("max_exp_avg_sq"), self.t,
                    lr=lr, betas=h["betas"], eps=h["eps"], wd=wd,
                    bias_correction=h["bias_correction"], phi_clamp=h["phi_clamp"],
                    trust_clamp=h["trust_clamp"], adapt=not self.excluded[s.index])
        if self.master is not None:
            params[...] = self.master.astype(params.dtype)
        return False, trusts
