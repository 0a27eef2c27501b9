"""The wrapped torch optimizer's step, bucket by bucket: step() updates each bucket's
parameters as soon as that bucket is reduced, while the later ones are still in flight, so
the update of most of the model overlaps the transfer of the rest.

Only for torch's optimizers that update each parameter from its own gradient and state
alone (exact types: a subclass may add a global rule), and with no step hooks registered
(they would run once per bucket). The step over a bucket is the optimizer's own step() with
each param group narrowed to that bucket's parameters for the call.
"""
from __future__ import annotations

import time

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ["PER_PARAMETER", "usable", "BucketSteps"]

PER_PARAMETER = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                 torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam,
                 torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop)


def usable(optimizer, buckets) -> bool:
    """Whether optimizer's step may run bucket by bucket over these buckets."""
    hooks = getattr(torch_optimizer, "_global_optimizer_pre_hooks", None) or \
        getattr(torch_optimizer, "_global_optimizer_post_hooks", None)
    return len(buckets) > 1 and type(optimizer) in PER_PARAMETER and not hooks and \
        not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


class BucketSteps:
    """Called with a bucket's (lo, hi): optimizer.step() over the parameters in it.
    `spent`: the seconds these steps took so far."""

    def __init__(self, optimizer, params, layout, buckets):
        self.optimizer, self.spent = optimizer, 0.0
        self.owner = {}                     # id(parameter) -> its bucket's (lo, hi)
        for lo, hi in buckets:
            for index, _, _ in layout.clip(lo, hi):
                self.owner[id(params[index])] = (lo, hi)

    def __call__(self, bounds) -> None:
        t0 = time.perf_counter()
        groups = self.optimizer.param_groups
        whole = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [p for p in g["params"] if self.owner.get(id(p)) == bounds]
            self.optimizer.step()
        finally:
            for g, params in zip(groups, whole):
                g["params"] = params
        self.spent += time.perf_counter() - t0
