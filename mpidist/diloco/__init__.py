"""DiLoCo and local SGD (Douillard et al. 2023; Stich 2019): groups of ranks train
data parallel for H inner steps, then exchange one outer gradient across groups.

    groups = make_groups(comm, group_size=0)          # a group per node by default
    outer = OuterOptimizer(params, layout, groups, lr=0.7, momentum=0.9)
    ... H inner steps on params within groups.group ...
    outer.sync(params, weight)                        # params <- the new theta_outer

streaming.py cuts the buffer into fragments with staggered outer steps (streaming DiLoCo);
asynchronous.py runs the outer step on parameter-server ranks with delayed Nesterov
(delayed.py), without a barrier between groups. The engine's strategies "diloco",
"local_sgd" and "diloco_async" and mpidist.torch.DiLoCo are built on these.
"""
from mpidist.diloco.groups import Groups, group_colors, make_groups
from mpidist.diloco.outer import OuterOptimizer

__all__ = ["Groups", "group_colors", "make_groups", "OuterOptimizer"]
