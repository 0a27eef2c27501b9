"""Uneven inputs for a DistributedOptimizer (its join()), as DDP's join() and Horovod's
hvd.join(): ranks whose loops end early keep the others' steps company until all are done.

1. shadow: a rank out of batches takes steps with no gradients (zero in the same bucket
   launches as the others', no update of its own); each step's flags allreduce, which
   carries whether a rank has joined, counts the ranks still active;
2. end: once that count is 0 (the update of that step skipped everywhere), every rank
   leaves together;
3. agree: all take the parameters, module buffers and optimizer state (a fused optimizer's
   torch-side hyperparameters too) of a rank that took the most steps.
The steps average over all ranks, the joined ones contributing zero (DDP's default). Inside
the loop the optimizer's are the only collectives; a scheduler stepped per batch counts
only a rank's own steps, so step schedulers per epoch there.
"""
from __future__ import annotations

from mpidist.torch.params import bcast_state, bcast_tensor

__all__ = ["shadow_until_all_joined"]


def shadow_until_all_joined(opt, steps: int) -> None:
    """Collective: opt's rank has left its loop after `steps` steps (phases 1-3)."""
    c, buckets = opt.comm, opt.buckets
    buckets.joined = True
    try:
        while True:                          # 1-2: shadow until no rank is active
            opt.zero_grad()
            opt.step()
            if buckets.active == 0:
                break
    finally:
        buckets.joined = False
    every = c.comm.allgather(steps)          # 3: the longest-running rank's state
    root = every.index(max(every))
    bcast_tensor(c, opt.storage.tparams, root)
    for b in opt.module_buffers:
        bcast_tensor(c, b.data, root)
    bcast_state(c, opt.optimizer, root)
    if opt.flat_update:                      # param_groups are the wrapper's own
        hyper = c.comm.bcast([{k: v for k, v in g.items() if k != "params"}
                              for g in opt.param_groups], root=root)
        for g, h in zip(opt.param_groups, hyper):
            g.update(h)
