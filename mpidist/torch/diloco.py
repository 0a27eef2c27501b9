"""DiLoCo and local SGD for torch models (Douillard et al. 2023, arXiv 2311.08105).

    import mpidist.torch as mt
    groups = mt.make_groups(group_size=2)                  # or groups=None: a group per node
    inner = mt.DistributedOptimizer(model, "adamw", lr=1e-3, comm=groups.group)
    opt = mt.DiLoCo(model, inner, sync_every=500, outer_lr=0.7, outer_momentum=0.9, groups=groups)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        opt.step()                  # the inner step; every sync_every steps also the outer one
        opt.zero_grad()
    opt.finish()                    # the rounds still open end now: every model is theta_outer

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
from mpidist.diloco.asynchronous import AsyncOuter, ServerGroups, split_servers
from mpidist.diloco.streaming import fragments_due, round_starts
from mpidist.flat import Layout
from mpidist.torch.params import named_parameters
from mpidist.torch.tensors import to_numpy

__all__ = ["DiLoCo", "AsyncDiLoCo", "make_groups", "split_servers"]


def _check_settings(sync_every, inner_optimizer, server: bool = False) -> None:
    """ValueError for a sync_every that is not a positive int, TypeError for an inner
    optimizer that is not a torch optimizer (a server has none)."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
    if not server and not isinstance(inner_optimizer, torch.optim.Optimizer):
        raise TypeError(f"inner_optimizer must be a torch optimizer (or an mpidist.torch "
                        f"DistributedOptimizer), got {type(inner_optimizer).__name__}")


class _FlatModel:
    """The model's trainable parameters and one flat float32 copy of them (the outer
    optimizers' buffer): _gather() copies the parameters in, _scatter() back out."""

    def _flatten(self, model) -> None:
        self.params = [p for _, p in named_parameters(model) if p.requires_grad]
        self.layout = Layout((f"p{i}", tuple(p.shape)) for i, p in enumerate(self.params))
        self.flat = np.empty(self.layout.numel, dtype=np.float32)
        self._gather()

    def _gather(self) -> None:
        for seg, p in zip(self.layout.segments, self.params):
            self.flat[seg.offset:seg.stop] = to_numpy(p.data).reshape(-1)

    def _scatter(self) -> None:
        with torch.no_grad():
            for seg, p in zip(self.layout.segments, self.params):
                p.copy_(torch.from_numpy(self.flat[seg.offset:seg.stop].reshape(seg.shape)))


class DiLoCo(_FlatModel):
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
        _check_settings(sync_every, inner_optimizer)
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
        self._flatten(model)
        self.inner = inner_optimizer
        self.sync_every = sync_every
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

    def finish(self) -> dict | None:
        """Collective, after the last inner step: the outer step of every fragment whose
        round is not over at this step, so that every rank's model ends on theta_outer
        (as the engine's job does). Returns that sync's report (or the last one)."""
        late = [f for f, start in enumerate(self.round_starts) if start != self.steps]
        return self.sync(late) if late else self.last_sync

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


class AsyncDiLoCo(_FlatModel):
    """DiLoCo without a barrier between groups: theta_outer on parameter-server ranks,
    updated by delayed Nesterov as each group pushes (mpidist.diloco.asynchronous; the
    engine's strategy "diloco_async" has the same options).

        topo = split_servers(servers=1, group_size=2)      # collective
        inner = None if topo.is_server else \
            mt.DistributedOptimizer(model, "adamw", lr=1e-3, comm=topo.groups.group)
        opt = AsyncDiLoCo(model, inner, topo, sync_every=500, rounds=40)
        if opt.is_server:
            opt.serve()                 # until every group is out of rounds
        else:
            while not opt.done:
                loss_fn(model(next_x), next_y).backward()
                opt.step()              # inner step; a push and pull after every sync_every
                opt.zero_grad()
        opt.close()                     # collective; every model now holds the final theta_outer

    inner_optimizer: as DiLoCo's, over topo.groups.group (None on a server).
    rounds: the budget of rounds, all groups together (a fast group takes more of them);
    outer_lr, outer_momentum, outer_delay: delayed Nesterov (delay 0: the number of groups).
    Construction is collective; every rank starts from world rank 0's parameters.
    """

    def __init__(self, model, inner_optimizer, topo: ServerGroups, *, sync_every: int, rounds: int,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, outer_delay: int = 0,
                 timeout: float = 300.0):
        if not isinstance(topo, ServerGroups):
            raise TypeError(f"topo must be split_servers(...)'s ServerGroups, got {type(topo).__name__}")
        _check_settings(sync_every, inner_optimizer, server=topo.is_server)
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
        topo.world.check_same((sync_every, rounds, float(outer_lr), float(outer_momentum), outer_delay),
                              "AsyncDiLoCo settings (sync_every, rounds, outer_lr, outer_momentum, outer_delay)")
        self._flatten(model)
        self.inner, self.sync_every = inner_optimizer, sync_every
        self.outer = AsyncOuter(self.flat, self.layout, topo, rounds=rounds, lr=outer_lr,
                                momentum=outer_momentum, delay=outer_delay, timeout=timeout)
        self._scatter()
        self.in_round = 0                 # inner steps in my group's current round
        self.done = False                 # out of rounds: the model holds the final theta_outer

    @property
    def is_server(self) -> bool:
        return self.outer.is_server

    def step(self, closure=None):
        """On a worker: the inner step, then after sync_every of them the push and the next
        round's pull (collective over the group). Once the budget is spent, the final
        theta_outer (collective over the world) and done; returns the inner step's result."""
        if self.is_server or self.done:
            raise RuntimeError("step() is for a worker with rounds left: servers serve(), and "
                               "a worker stops once opt.done")
        if self.outer.round < 0:          # the first round, from the current theta_outer
            if not self.outer.begin(self.flat):
                return self._finish()
            self._scatter()
        out = self.inner.step(closure) if closure is not None else self.inner.step()
        self.in_round += 1
        if self.in_round >= self.sync_every:
            self._gather()
            more = self.outer.sync(self.flat)
            self.in_round = 0
            if not more:
                self._finish()
            self._scatter()
        return out

    def serve(self) -> None:
        """On a server: apply the groups' pushes until every group is out of rounds, then
        take the final theta_outer (collective over the world)."""
        self.outer.serve()
        self._finish()

    def _finish(self) -> None:
        self.outer.finalize(self.flat)
        self._scatter()
        self.done = True

    def report(self) -> dict:
        """Collective: rounds pushed per group (AsyncOuter.report)."""
        return self.outer.report()

    def close(self) -> None:
        """Collective: free the parameter server's windows."""
        self.outer.close()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

