"""PyTorch models on mpidist: gradients reduced while backward runs, fused updates over
flat buffers. Needs torch (the `[torch]` extra); `import mpidist` does not.

    import mpidist.torch as mt
    opt = mt.DistributedOptimizer(model, "adamw", lr=1e-3)    # or a torch.optim optimizer

Importing it registers the "mpidist" torch.distributed backend (mpidist.torch.backend).
"""
# importing the backend registers "mpidist" with torch.distributed
from mpidist.torch.backend import init_process_group
from mpidist.torch.diloco import AsyncDiLoCo, DiLoCo, make_groups
from mpidist.torch.optimizer import (DistributedOptimizer, broadcast_optimizer_state,
                                     broadcast_parameters, named_parameters)
from mpidist.torch.sampler import DistributedSampler

__all__ = ["DistributedOptimizer", "DiLoCo", "AsyncDiLoCo", "make_groups", "DistributedSampler",
           "broadcast_parameters", "broadcast_optimizer_state", "named_parameters",
           "init_process_group"]
