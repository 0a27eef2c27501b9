"""Hyperparameters per group of tensors (torch's param_groups) for the flat-buffer optimizers.

A torch script keeps its hyperparameters in `param_groups` and changes them between steps
(schedulers write lr, OneCycleLR momentum or betas; biases often get no weight decay).
set_hyper and set_groups carry those values into an optimizer over a flat buffer: groups
that differ only in weight decay update in one fused pass (the kernels take a decay per
segment); groups that differ in more update in one pass each, over their own segments.
"""
from __future__ import annotations

import numpy as np

from mpidist.optim.checks import check_betas, check_eps, check_number

__all__ = ["ParamGroups", "GROUP_CHECKS"]

# the checks of the hyperparameters a param group may set (Optimizer.group_hyper)
GROUP_CHECKS = {
    "betas": check_betas, "eps": check_eps,
    "momentum": lambda v: check_number("momentum", v, 0.0),
    "dampening": lambda v: check_number("dampening", v, 0.0, 1.0),
    "eta": lambda v: check_number("eta", v, 0.0, lo_open=True),
}


class ParamGroups:
    """The mixin of mpidist.optim.base.Optimizer that sets hyperparameters per group of
    segments (a segment: one tensor of the layout)."""

    group_hyper: tuple[str, ...] = ()      # set per param group beside lr and weight_decay
    _runs = None                           # set_groups: [(hyper, segments, weight decays)]
    _seg_wd = None                         # the weight decay per segment of the running group

    def set_hyper(self, **values) -> None:
        """Set lr, weight_decay and the names in group_hyper (checked; other names are
        ignored, as torch's param_groups carry schedulers' keys too)."""
        checks = {"weight_decay": lambda v: check_number("weight_decay", v, 0.0), **GROUP_CHECKS}
        for name, value in values.items():
            if name == "lr":
                self.lr = value
            elif name == "weight_decay" or name in self.group_hyper:
                value = checks[name](value)
                if name == "momentum" and value > 0 and "momentum_buffer" not in self._state:
                    raise ValueError("momentum was 0 when the optimizer was built (it keeps "
                                     "no momentum buffer); build it with momentum > 0")
                setattr(self, name, value)

    def set_groups(self, groups) -> None:
        """Hyperparameters per group of tensors, as torch's param_groups, from the next step
        on: groups is a list of (segments, hyper), a bool per layout segment (groups apart)
        and {name: value} as set_hyper takes; None: one group, the optimizer's own values.
        Groups that differ only in weight decay update in one pass (decay per segment),
        others in a pass each over their segments (CPU kernels). A segment in no group is
        not updated (a tensor that got no gradient, as torch skips it)."""
        if groups is None:
            self._runs = None
            return
        nseg, seen, runs = len(self.layout), np.zeros(len(self.layout), bool), {}
        for segments, hyper in groups:
            mask = np.asarray(segments, bool)
            if mask.shape != (nseg,) or (mask & seen).any():
                raise ValueError(f"each group needs a bool per layout segment ({nseg}), "
                                 f"the groups apart")
            seen |= mask
            self.set_hyper(**hyper)           # checks them (the last group's stay)
            key = tuple((k, self._frozen(k)) for k in sorted(("lr",) + self.group_hyper))
            m, wd = runs.setdefault(key, (np.zeros(nseg, bool), np.zeros(nseg)))
            m |= mask
            wd[mask] = self.weight_decay
        self._runs = [(dict(k), m, np.where(self.excluded, 0.0, wd)) for k, (m, wd) in runs.items()]

    def _frozen(self, name):
        value = self._lr if name == "lr" else getattr(self, name)
        return tuple(value) if isinstance(value, list) else value

    def _update_groups(self, kern, work, g, gscale, reduce_norms, finite):
        """One step in passes over set_groups' groups, each with its values and the same
        step count (every rank makes the same passes: reduce_norms stays collective)."""
        if finite is None and not kern.all_finite(g):
            return self._skip("non-finite gradients")
        t, info = self.step_count, None
        try:
            for hyper, mask, wd in self._runs:
                self.step_count = t
                self.set_hyper(**hyper)
                self._seg_wd = wd
                info = self._update(kern if mask.all() else self._kernels_only(kern, mask), work,
                                    g, gscale, self.lr, reduce_norms, True)
        finally:
            self._seg_wd = None
        return info

    def _kernels_only(self, kern, mask):
        """The CPU kernels over the segments marked in mask (cached)."""
        from mpidist.kernels.optim_cpu import CPUKernels        # Numba, as _kernels_for
        if not isinstance(kern, CPUKernels):
            raise ValueError("parameter groups that differ in more than weight decay need the "
                             "CPU kernels; give the groups the same lr and betas/momentum")
        key = ("cpu", mask.tobytes())
        if key not in self._kernels:
            self._kernels[key] = CPUKernels(self.plan.only(mask))
        return self._kernels[key]

