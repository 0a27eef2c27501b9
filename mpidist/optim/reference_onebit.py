"""Plain NumPy reference of 1-bit Adam and 1-bit LAMB over `size` simulated ranks, for tests.

The papers' algorithms as mpidist.optim.onebit states them, written one rank and one
tensor at a time in one process: the warm-up is AdamW / LAMB (mpidist.optim.reference) on
the sum of the ranks' gradients; then every rank's local momentum goes through its worker
compressor (error feedback, one piece per chunk owner), each owner averages its chunk in
rank order and compresses it with its server compressor (error feedback), and every rank
decodes the same averaged momentum. Same arithmetic contract as the kernels (float32
element-wise, hyperparameters rounded to float32 once, sums of squares in float64), so a
distributed run that agrees with this to rtol 1e-6 implements the algorithm.
The compressors are passed in (make_compressor() -> a fresh mpidist.compress compressor):
they are the algorithm's parameter, tested on their own.
See docs/ARCHITECTURE.md (optimizers).
"""
from __future__ import annotations

import numpy as np

from mpidist.optim.reference import adamw, lamb, sumsq
from mpidist.partition import chunk

__all__ = ["OnebitReference"]

f32 = np.float32


class OnebitReference:
    """The reference twin of a OnebitAdam / OnebitLAMB over a whole layout, simulating
    `size` ranks. step(params, grads) takes every rank's gradient (grads[i], summed over
    ranks they make the gradient) and returns the per-tensor coefficients (LAMB) or None."""

    def __init__(self, opt, size: int, make_compressor):
        if opt.offset != 0 or opt.count != opt.layout.numel:
            raise ValueError("the reference covers a whole layout; build the optimizer "
                             "without offset/count")
        self.name, self.h, self.layout = opt.name, opt.hyper(), opt.layout
        self.excluded, self.size = opt.excluded, int(size)
        n = self.layout.numel
        self.m, self.v, self.vf = (np.zeros(n, f32) for _ in range(3))
        self.t = 0
        self.workers, self.servers = [], []
        for r in range(self.size):
            w, s = make_compressor(), make_compressor()
            w.stream = s.stream = r          # as the distributed run numbers its streams
            self.workers.append(w)
            self.servers.append(s)
        self.coeff_avg = np.zeros(len(self.layout))
        self.last_factor = np.ones(len(self.layout))

    def wd(self, s) -> float:
        return 0.0 if self.excluded[s.index] else self.h["weight_decay"]

    def step(self, w, grads):
        self.t += 1
        h = self.h
        if self.t <= h["freeze_step"]:
            return self._warmup(w, grads)
        b1, b2 = h["betas"]
        # 1. each rank's local momentum b1*m + (1-b1)*(size*g_i), divided by the frozen
        #    denominator (0 where v = 0) with preconditioning
        den = np.ones_like(self.v)
        if h["precondition"]:
            bc2 = 1.0 - b2 ** h["freeze_step"] if h["bias_correction"] else 1.0
            den = np.where(self.v > 0, np.sqrt(self.v / f32(bc2)) + f32(h["eps"]), f32(0.0))
        local = []
        for g in grads:
            x = f32(b1) * self.m + f32(1.0 - b1) * (f32(self.size) * g)
            local.append(np.where(den > 0, x / np.where(den > 0, den, f32(1.0)), f32(0.0)))
        # 2. worker side: one compressed piece per owner (worker residuals kept)
        owners = [chunk(len(w), r, self.size) for r in range(self.size)]
        sent = [c.compress_pieces(x, owners) for c, x in zip(self.workers, local)]
        # 3. server side: the owner sums its pieces in rank order, averages, compresses
        #    (server residual kept); every rank decodes the same averaged momentum
        m_old = self.m.copy()
        for r, (off, cnt) in enumerate(owners):
            total = np.zeros(cnt, f32)
            for i in range(self.size):
                payload, _ = sent[i][r]
                self.workers[r].decode_add(payload, sent[r][r][1], total)
            total = total * f32(1.0 / self.size)
            payload, ctx = self.servers[r].compress(total)
            self.m[off:off + cnt] = self.servers[r].decompress(payload, ctx) * den[off:off + cnt]
        # 4. the update with the frozen variance
        return self._frozen(w, m_old)

    # ---------------------------------------------------------------- warm-up
    def _warmup(self, w, grads):
        h = self.h
        g = np.zeros_like(w)
        for gi in grads:             # the sum over ranks, in rank order
            g += gi
        coeffs = np.ones(len(self.layout))
        for s in self.layout:
            sl = slice(s.offset, s.stop)
            if self.name == "onebit_adam":
                adamw(w[sl], g[sl], self.m[sl], self.v[sl], None, self.t, lr=h["lr"],
                      betas=h["betas"], eps=h["eps"], wd=self.wd(s),
                      bias_correction=h["bias_correction"])
            else:
                coeffs[s.index] = lamb(
                    w[sl], g[sl], self.m[sl], self.v[sl], None, self.t, lr=h["lr"],
                    betas=h["betas"], eps=h["eps"], wd=self.wd(s),
                    bias_correction=h["bias_correction"], phi_clamp=h["phi_clamp"],
                    trust_clamp=h["trust_clamp"], adapt=not self.excluded[s.index])
        if self.name == "onebit_adam":
            return None
        beta = h["coeff_beta"]
        self.coeff_avg = beta * self.coeff_avg + (1.0 - beta) * coeffs
        if self.t == h["freeze_step"]:
            self.vf[...] = self.v
        return coeffs

    # ---------------------------------------------------------------- compression stage
    def _frozen(self, w, m_old):
        h = self.h
        b1, b2 = h["betas"]
        bc1, bc2, bc2t = 1.0, 1.0, 1.0
        if h["bias_correction"]:
            bc1, bc2, bc2t = 1.0 - b1 ** self.t, 1.0 - b2 ** h["freeze_step"], 1.0 - b2 ** self.t
        eps = f32(h["eps"])
        coeffs = np.ones(len(self.layout))
        for s in self.layout:
            sl = slice(s.offset, s.stop)
            ws, m, v = w[sl], self.m[sl], self.v[sl]
            wd = f32(self.wd(s))
            den = np.sqrt(v / f32(bc2)) + eps
            r = np.where(v > 0, (m / f32(bc1)) / den, f32(0.0))   # v = 0: never a gradient
            if self.name == "onebit_adam":
                ws -= f32(h["lr"]) * (r + wd * ws)
                continue
            # 1-bit LAMB: the fresh variance from the gradient the momentum implies
            g = (m - f32(b1) * m_old[sl]) / f32(1.0 - b1)
            self.vf[sl] = f32(b2) * self.vf[sl] + f32(1.0 - b2) * (g * g)
            u = r + wd * ws
            factor = float(np.max(den / (np.sqrt(self.vf[sl] / f32(bc2t)) + eps)))
            un, rn = np.sqrt(sumsq(u)), np.sqrt(sumsq(r))
            if self.excluded[s.index]:
                coeff = 1.0
            else:
                if wd > 0 and un > 0:
                    q = min(1.0, rn / un)
                    factor = factor * q + (1.0 - q)
                factor = min(max(factor, h["factor_min"]), h["factor_max"])
                last = self.last_factor[s.index]
                factor = min(max(factor, last * (1.0 - h["factor_threshold"])),
                             last * (1.0 + h["factor_threshold"]))
                self.last_factor[s.index] = factor
                avg = self.coeff_avg[s.index] / (1.0 - h["coeff_beta"] ** h["freeze_step"])
                coeff = avg * factor
            coeffs[s.index] = coeff
            ws -= f32(h["lr"] * coeff) * u
        return None if self.name == "onebit_adam" else coeffs
