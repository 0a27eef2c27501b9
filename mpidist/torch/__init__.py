"""PyTorch models on mpidist: gradients reduced while backward runs, fused updates over
flat buffers. Needs torch (the `[torch]` extra); `import mpidist` does not.

    import mpidist.torch as mt
    opt = mt.DistributedOptimizer(model, "adamw", lr=1e-3)    # or a torch.optim optimizer
"""
from mpidist.torch.optimizer import (DistributedOptimizer, broadcast_optimizer_state,
                                     broadcast_parameters, named_parameters)

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
           "named_parameters"]
