"""DiLoCo and local SGD for torch models (Douillard et al. 2023, arXiv 2311.08105).

    import mpidist.torch as mt
    groups = mt.make_groups(group_size=2)                  # or groups=None: a group per node
    inner = mt.DistributedOptimizer(model, "adamw", lr=1e-3, comm=groups.group)
    opt = mt.DiLoCo(model, inner, sync_every=500, outer_lr=0.7, outer_momentum=0.9, groups=groups)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        opt.step()                  # the inner step; every sync_every steps also the outer one
        opt.zero_grad()

The inner step is the inner optimizer's, data parallel within the group (mpidist.torch's
DistributedOptimizer over groups.group; a plain torch optimizer makes every rank its own
group's only worker). Every sync_every inner steps the outer step of mpidist.diloco runs
across the groups: 1. outer gradient theta_outer - theta_group, 2. its weighted sum over the
group leaders (compressed where asked), 3. broadcast within the group, 4. Nesterov SGD on
theta_outer, which every rank's model then takes. Groups are weighted by their share of
the ranks (each rank reads as many samples, as a DistributedSampler gives them). Local SGD
is outer_lr=1, outer_momentum=0. The options are the engine's strategy's (docs/JOBS.md).
"""
from __future__ import annotations

import numpy as np
import torch

from mpidist.comm import as_communicator
from mpidist.diloco import Groups, OuterOptimizer, make_groups
from mpidist.diloco.streaming import fragments_due, round_starts
from mpidist.flat import Layout
from mpidist.torch.params import named_parameters
from mpidist.torch.tensors import to_numpy

__all__ = ["DiLoCo", "make_groups"]


class DiLoCo:
    """Inner steps within groups of ranks, an outer step across them every sync_every steps.

    model: the torch module (or its named_parameters()) both optimizers train.
    inner_optimizer: a torch optimizer over the model's parameters; an mpidist.torch
      DistributedOptimizer must run over groups.group.
    sync_every: H, the inner steps between outer steps.
    outer_lr, outer_momentum: the outer SGD (Nesterov when momentum > 0); local SGD: 1, 0.
    groups: None (a group per node), an int (runs of that many ranks) or
      mpidist.diloco.make_groups(...)'s Groups.
    outer_compression: None or a compressor name of mpidist.compress (fp16, bf16, sign, ...)
      for the exchange between groups, with outer_compression_options.
    fragments: streaming DiLoCo (mpidist.diloco.streaming): the model in this many fragments
      of whole tensors, each with its outer step on its own offset within every H steps.
    comm: the job's communicator (with groups=None or an int). Construction is collective;
    every rank starts from world rank 0's parameters.
    """

    def __init__(self, model, inner_optimizer, *, sync_every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, groups=None, outer_compression: str | None = None,
                 outer_compression_options: dict | None = None, fragments: int = 1, comm=None):
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"inner_optimizer must be a torch optimizer (or an mpidist.torch "
                            f"DistributedOptimizer), got {type(inner_optimizer).__name__}")
        if isinstance(groups, Groups):
            self.groups = groups
        else:
            self.groups = make_groups(as_communicator(comm), 0 if groups is None else groups)
        g = self.groups
        inner_comm = getattr(inner_optimizer, "comm", None)
        error = None
        if inner_comm is not None and inner_comm.size != g.group.size:
            error = ValueError(f"the inner DistributedOptimizer runs over {inner_comm.size} ranks, "
                               f"the group over {g.group.size}: build it with comm=groups.group")
        g.world.raise_if_any(error)
        g.world.check_same((int(sync_every), float(outer_lr), float(outer_momentum), outer_compression, fragments),
                           "DiLoCo settings (sync_every, outer_lr, outer_momentum, outer_compression, fragments)")
        self.params = [p for _, p in named_parameters(model) if p.requires_grad]
        self.layout = Layout((f"p{i}", tuple(p.shape)) for i, p in enumerate(self.params))
        self.inner = inner_optimizer
        self.sync_every = sync_every
        self.flat = np.empty(self.layout.numel, dtype=np.float32)
        self._gather()
        self.outer = OuterOptimizer(self.flat, self.layout, g, lr=outer_lr, momentum=outer_momentum,
                                    compression=outer_compression or "none",
                                    compression_options=outer_compression_options, fragments=fragments)
        self._scatter()
        self.weight = g.group.size / g.world.size
        self.steps = 0                    # inner steps taken
        self.round_starts = round_starts(0, sync_every, fragments)
        self.last_sync: dict | None = None

    @property
    def step_in_round(self) -> int:
        """Inner steps since the last outer step (of the first fragment)."""
        return self.steps - self.round_starts[0]

    def _gather(self) -> None:
        for seg, p in zip(self.layout.segments, self.params):
            self.flat[seg.offset:seg.stop] = to_numpy(p.data).reshape(-1)

    def _scatter(self) -> None:
        with torch.no_grad():
            for seg, p in zip(self.layout.segments, self.params):
                p.copy_(torch.from_numpy(self.flat[seg.offset:seg.stop].reshape(seg.shape)))

    def step(self, closure=None):
        """The inner step; after every sync_every of them, the outer step (collective over
        the world then; of each fragment on its own schedule). Returns the inner step's result."""
        out = self.inner.step(closure) if closure is not None else self.inner.step()
        self.steps += 1
        due = fragments_due(self.steps, self.round_starts, self.sync_every)
        if due:
            self.sync(due)
        return out

    def sync(self, fragments=None) -> dict:
        """Collective: the outer step now, of these fragments (None: all;
        mpidist.diloco.OuterOptimizer.sync)."""
        self._gather()
        self.last_sync = self.outer.sync(self.flat, self.weight, fragments)
        self._scatter()
        for f in range(len(self.round_starts)) if fragments is None else fragments:
            self.round_starts[f] = self.steps
        return self.last_sync

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The outer state (theta_outer, outer momentum and step, the step within the round)
        and the inner optimizer's own state_dict(); the model's parameters are the caller's
        to save (they are this group's theta_inner)."""
        return {"theta_outer": torch.from_numpy(self.outer.theta.copy()),
                "outer_state": {k: torch.from_numpy(v) for k, v in self.outer.state_buffers().items()},
                "outer_steps": self.outer.step_counts, "outer_syncs": self.outer.steps,
                "steps": self.steps, "round_starts": list(self.round_starts),
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict()'s output (load the model's parameters alongside)."""
        self.outer.theta[...] = state["theta_outer"].numpy()
        self.outer.load_state_buffers({k: v.numpy() for k, v in state["outer_state"].items()})
        self.outer.step_counts = state["outer_steps"]
        self.outer.steps = int(state["outer_syncs"])
        self.steps, self.round_starts = int(state["steps"]), list(state["round_starts"])
        self.inner.load_state_dict(state["inner"])
