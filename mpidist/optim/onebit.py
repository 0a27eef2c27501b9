"""1-bit Adam (Tang et al. 2021, arXiv 2102.02888) and 1-bit LAMB (Li et al. 2021, arXiv
2104.06069): Adam-family optimizers whose communication can be compressed.

Error feedback fails with Adam because the variance is a nonlinear function of the gradient,
so both papers run in two stages:
  1. warm-up (the first `freeze_step` steps): plain AdamW / LAMB on the averaged gradient;
  2. compression stage: the variance frozen; each rank forms its local momentum
     (`local_momentum`), the engine averages it through a compressor with error feedback on
     both sides (mpidist.compress.momentum), and step() takes the averaged momentum in
     place of the gradient.
The update rules are in each class's docstring. See docs/COMPRESSION.md and
docs/ARCHITECTURE.md (optim).
"""
from __future__ import annotations

import numbers

import numpy as np

from mpidist.kernels.backend import get_array_module
from mpidist.optim.adamw import AdamW
from mpidist.optim.base import DEFAULT_EXCLUDE, StepInfo
from mpidist.optim.checks import check_number
from mpidist.optim.lamb import LAMB

__all__ = ["OnebitAdam", "OnebitLAMB", "ONEBIT_DEFAULTS"]

# the momentum compressor when none is named: 1-bit signs with a per-chunk scale
ONEBIT_DEFAULTS = {"freeze_step": 100, "compressor": "sign"}


def _check_onebit(freeze_step, compressor, compressor_options, precondition):
    if not isinstance(precondition, bool):
        raise TypeError(f"precondition must be true or false, got {precondition!r}")
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, numbers.Integral) or \
            freeze_step < 1:
        raise ValueError(f"freeze_step must be an integer >= 1 (uncompressed warm-up steps "
                         f"that estimate the variance), got {freeze_step!r}")
    if not isinstance(compressor, str) or not compressor:
        raise TypeError(f"compressor must be a compressor name of mpidist.compress (e.g. "
                        f"'sign', 'topk', 'randomk', 'qsgd'), got {compressor!r}")
    options = {} if compressor_options is None else compressor_options
    if not isinstance(options, dict):
        raise TypeError(f"compressor_options must be a table of the compressor's options, "
                        f"got {type(options).__name__}")
    if options.get("error_feedback", True) is not True:
        raise ValueError("1-bit optimizers need error feedback on the momentum: leave "
                         "compressor_options.error_feedback unset (or true)")
    return int(freeze_step), compressor, dict(options), precondition


class _Onebit:
    """What both 1-bit optimizers add to their warm-up optimizer.

    With precondition=True (the default) what is compressed is m_i / den, den =
    sqrt(v/bc2_f) + eps the frozen denominator (0 where v = 0: there m is 0), and the average
    is multiplied back by den: the same average, but the compression error lands evenly on
    the update m/den instead of being amplified 1/den-fold where v is small. It is a
    per-element form of 1-bit LAMB's per-tensor momentum scaling (DeepSpeed's
    scaling_coeff); on the digits job (LAMB, eps 1e-6) plain momentum diverged right after
    the freeze: signs give the rarely-active inputs' weights the chunk's mean momentum,
    which over their tiny sqrt(v) became huge steps.
    """

    onebit = True

    def _init_onebit(self, freeze_step, compressor, compressor_options, precondition):
        self.freeze_step, self.compressor, self.compressor_options, self.precondition = \
            _check_onebit(freeze_step, compressor, compressor_options, precondition)
        # the engine sets this for a shard (ZeRO): callable(per-segment array) -> the
        # element-wise maximum over the shards (1-bit LAMB's factor); None: my range is all
        self.reduce_max = None

    @property
    def frozen(self) -> bool:
        """True once the warm-up is over: step() then takes the averaged momentum."""
        return self.step_count >= self.freeze_step

    def _onebit_hyper(self) -> dict:
        return {"freeze_step": self.freeze_step, "compressor": self.compressor,
                "compressor_options": dict(self.compressor_options),
                "precondition": self.precondition}

    def frozen_corrections(self, t: int) -> tuple[float, float]:
        """(1 - b1^t, 1 - b2^freeze_step): the momentum's correction goes on, the frozen
        variance's stays; (1, 1) without bias correction."""
        b1, b2 = self.betas
        if not self.bias_correction:
            return 1.0, 1.0
        return 1.0 - b1 ** t, 1.0 - b2 ** self.freeze_step

    def frozen_denominator(self, v):
        """The scale the momentum is compressed in (float32, like v, which may be any
        range): sqrt(v/bc2_f) + eps, 0 where v = 0; ones without preconditioning."""
        xp = get_array_module(v)
        if not self.precondition:
            return xp.ones(v.shape, np.float32)
        _, bc2 = self.frozen_corrections(self.freeze_step)
        den = xp.sqrt(v / np.float32(bc2)) + np.float32(self.eps)
        return xp.where(v > 0, den, np.float32(0.0)).astype(np.float32)

    def local_momentum(self, momentum, grads, den, mult: float = 1.0) -> None:
        """In place: grads <- (b1*momentum + (1-b1)*(mult*grads)) / den (0 where den = 0),
        this rank's momentum to send in the frozen_denominator's scale (mult: what makes
        this rank's gradient an estimate of the average, e.g. the rank count when gradients
        are summed over ranks; 1/loss_scale folds in here). All float32 of one length, any
        range of the layout."""
        if not self.frozen:
            raise RuntimeError(f"local_momentum is for the compression stage (from step "
                               f"{self.freeze_step}); this optimizer is at step "
                               f"{self.step_count}")
        for what, a in (("momentum", momentum), ("grads", grads), ("den", den)):
            if getattr(a, "dtype", None) != np.float32 or getattr(a, "ndim", 0) != 1:
                raise TypeError(f"{what} must be a 1-D float32 array")
            if a.shape != grads.shape:
                raise ValueError(f"{what} {a.shape} and grads {grads.shape} differ in length")
        check_number("mult", mult, 0.0, lo_open=True)
        xp = get_array_module(grads)
        self._kernels_for(xp).onebit_momentum(momentum, grads, den, self.betas[0], float(mult))


class OnebitAdam(_Onebit, AdamW):
    """1-bit Adam over a flat-buffer range; AdamW in warm-up. After the freeze:

        w -= lr * (r + wd*w),  r = (m/bc1) / (sqrt(v/bc2_f) + eps),  bc2_f = 1 - b2^freeze_step

    r = 0 where v = 0 (no gradient ever reached the element, e.g. an always-zero input: its
    momentum is compression noise only, which signs cannot make 0, and over eps it would be
    a huge step; DeepSpeed asks the user for such a mask, here the frozen variance gives it).
    """

    name = "onebit_adam"

    def __init__(self, layout, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 bias_correction=True, exclude=(), freeze_step=ONEBIT_DEFAULTS["freeze_step"],
                 compressor=ONEBIT_DEFAULTS["compressor"], compressor_options=None,
                 precondition=True, **kw):
        self._init_onebit(freeze_step, compressor, compressor_options, precondition)
        super().__init__(layout, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=False, bias_correction=bias_correction, exclude=exclude, **kw)

    def hyper(self):
        h = super().hyper()
        del h["amsgrad"]
        return {**h, **self._onebit_hyper()}

    def _update(self, kern, work, g, gscale, lr, reduce_norms, finite):
        if not self.frozen:
            return super()._update(kern, work, g, gscale, lr, reduce_norms, finite)
        # compression stage: g is the averaged momentum
        if not (kern.all_finite(g) if finite is None else finite):
            return self._skip("non-finite momentum")
        bc1, bc2 = self.frozen_corrections(self.step_count + 1)
        s = self._state
        seg_c = np.full(self.plan.nseg, float(lr))
        kern.onebit_adam_update(work, g, s["exp_avg_sq"], s["exp_avg"], self.seg_wd(), seg_c,
                                bc1, bc2, self.eps)
        return self._done(lr)


class OnebitLAMB(_Onebit, LAMB):
    """1-bit LAMB over a flat-buffer range; LAMB in warm-up.

    Warm-up also keeps an exponential average of each tensor's trust ratio (`coeff_beta`),
    and the last warm-up step copies v into a fresh variance vf. After the freeze:

        g = (m - b1*m_old)/(1-b1) ;  vf = b2*vf + (1-b2)*g^2 ;  den = sqrt(v/bc2_f) + eps
        r = (m/bc1)/den (0 where v = 0) ;  u = r + wd*w
        factor_s = max over tensor s of den / (sqrt(vf/bc2) + eps)
          (with weight decay: factor*q + (1 - q), q = min(1, ||r_s|| / ||u_s||)),
          clipped to [factor_min, factor_max] and to within factor_threshold of the last
          step's factor
        w -= lr * coeff_s * factor_s * u          coeff_s: the warm-up's averaged ratio

    The factor lets the frozen ratio follow the gradient's scale as the fresh variance sees
    it (1-bit LAMB, Algorithm 1). Tensors excluded from adaptation (biases, norms) keep
    coefficient 1. State beyond LAMB's: exp_avg_sq_fresh (per element) and, per tensor, the
    ratio average and last factor (extra_state(): small, the same on every rank).
    """

    name = "onebit_lamb"
    state_names = ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh")

    def __init__(self, layout, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=1e-2,
                 bias_correction=True, phi_clamp=(0.0, np.inf), trust_clamp=(0.0, np.inf),
                 exclude=DEFAULT_EXCLUDE, freeze_step=ONEBIT_DEFAULTS["freeze_step"],
                 compressor=ONEBIT_DEFAULTS["compressor"], compressor_options=None,
                 precondition=True, coeff_beta=0.9, factor_min=0.5, factor_max=4.0,
                 factor_threshold=0.1, **kw):
        self._init_onebit(freeze_step, compressor, compressor_options, precondition)
        self.coeff_beta = check_number("coeff_beta", coeff_beta, 0.0, 1.0, hi_open=True)
        self.factor_min = check_number("factor_min", factor_min, 0.0, 1.0, lo_open=True)
        self.factor_max = check_number("factor_max", factor_max, 1.0, np.inf, hi_open=True)
        self.factor_threshold = check_number("factor_threshold", factor_threshold, 0.0, 1.0,
                                             hi_open=True)
        super().__init__(layout, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, amsgrad=False, phi_clamp=phi_clamp,
                         trust_clamp=trust_clamp, exclude=exclude, **kw)
        self.coeff_avg = np.zeros(self.plan.nseg)       # exponential average of the ratios
        self.last_factor = np.ones(self.plan.nseg)

    def hyper(self):
        h = super().hyper()
        del h["amsgrad"]
        return {**h, **self._onebit_hyper(), "coeff_beta": self.coeff_beta,
                "factor_min": self.factor_min, "factor_max": self.factor_max,
                "factor_threshold": self.factor_threshold}

    def extra_state(self) -> dict:
        return {"coeff_avg": self.coeff_avg.tolist(), "last_factor": self.last_factor.tolist()}

    def load_extra_state(self, extra: dict) -> None:
        for key in ("coeff_avg", "last_factor"):
            value = np.asarray(extra.get(key, []), dtype=np.float64)
            if value.shape != (self.plan.nseg,):
                raise ValueError(f"onebit_lamb state {key!r} must have one entry per tensor "
                                 f"({self.plan.nseg}), got shape {value.shape}")
            setattr(self, key, value.copy())

    def partial_sums(self, params, grads, *, loss_scale: float = 1.0) -> np.ndarray:
        """As LAMB's during the warm-up; after the freeze the sums are taken inside step()."""
        if self.frozen:
            raise RuntimeError("after the warm-up 1-bit LAMB sums over the averaged momentum "
                               "inside step(); call step(params, momentum, reduce_norms)")
        return super().partial_sums(params, grads, loss_scale=loss_scale)

    def frozen_coefficients(self) -> np.ndarray:
        """Each tensor's warm-up trust ratio average (bias-corrected: the average starts
        at 0); 1 for excluded tensors."""
        avg = self.coeff_avg / (1.0 - self.coeff_beta ** self.freeze_step)
        return np.where(self.excluded, 1.0, avg)

    def _update(self, kern, work, g, gscale, lr, reduce_norms, finite):
        if not self.frozen:
            info = super()._update(kern, work, g, gscale, lr, reduce_norms, finite)
            if not info.skipped:
                beta = self.coeff_beta
                self.coeff_avg = beta * self.coeff_avg + (1.0 - beta) * info.trust_ratios
                if self.step_count == self.freeze_step:     # the last warm-up step
                    self._state["exp_avg_sq_fresh"][...] = self._state["exp_avg_sq"]
            return info
        # compression stage: g is the averaged momentum
        s = self._state
        t = self.step_count + 1
        bc1, bc2 = self.frozen_corrections(t)
        bc2t = 1.0 - self.betas[1] ** t if self.bias_correction else 1.0
        states = (s["exp_avg"], s["exp_avg_sq"], s["exp_avg_sq_fresh"])
        consts = (self.betas[0], self.betas[1], self.eps, bc1, bc2, bc2t)
        # 1. per-tensor sums (w^2, u^2, r^2) and the max ratio over my range, then global
        partials = kern.onebit_lamb_sums(work, g, *states, self.seg_wd(), *consts)
        totals = self._reduced(partials[:, :3], reduce_norms)
        top = partials[:, 3]
        if self.reduce_max is not None:
            top = np.asarray(self.reduce_max(top.copy()), dtype=np.float64)
        ok = bool(np.isfinite(totals[:, 1].sum()) and np.isfinite(top).all()) \
            if finite is None else finite
        if not ok:
            return self._skip("non-finite momentum")
        # 2. the factor per tensor, then the coefficient lr * coeff * factor
        factor = self._factor(totals, top)
        self.last_factor = np.where(self.excluded, 1.0, factor)
        coeff = self.frozen_coefficients() * self.last_factor
        kern.onebit_lamb_update(work, g, *states, self.seg_wd(), float(lr) * coeff, *consts)
        return self._done(lr, coeff)

    def _factor(self, totals, top) -> np.ndarray:
        un, rn = np.sqrt(totals[:, 1]), np.sqrt(totals[:, 2])
        factor = top.copy()
        decayed = (self.seg_wd() > 0) & (un > 0)
        q = np.minimum(1.0, rn / np.where(decayed, un, 1.0))
        factor = np.where(decayed, factor * q + (1.0 - q), factor)
        factor = np.clip(factor, self.factor_min, self.factor_max)
        last = self.last_factor
        return np.clip(factor, last * (1.0 - self.factor_threshold),
                       last * (1.0 + self.factor_threshold))
