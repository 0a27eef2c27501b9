"""Asynchronous DiLoCo over the parameter server: groups never wait for each other.

Server ranks hold theta_outer in the parameter server's one-sided windows
(mpidist.ps) and update it with delayed Nesterov (mpidist.diloco.delayed; Liu et al. 2024,
arXiv 2401.09135). The other ranks form groups, data parallel inside. A group's round:
    1. claim: the leader takes the next round from a shared counter (a fetch-and-add on
       the first server); past the budget of rounds, the group stops;
    2. pull theta_outer (it holds every push applied so far); the leader broadcasts it in
       the group; every rank starts its inner steps from it;
    3. H inner steps within the group;
    4. push: the leader adds its outer gradient (theta_start - theta_inner, weighted by the
       group's share of the workers) into the servers' windows, waits for the servers (not
       the other groups) to apply it, and claims the next round (1).
A fast group claims more rounds than a slow one; the only wait between groups is at the
end, for the last rounds to be applied. With one group, delay 1, and no straggler this is
synchronous DiLoCo with one group.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from mpidist.comm import Communicator, as_communicator
from mpidist.diloco.delayed import DelayedNesterov
from mpidist.diloco.groups import Groups, group_colors, make_groups
from mpidist.kernels.backend import get_array_module, to_numpy
from mpidist.ps.counter import SharedCounter
from mpidist.ps.server import ParameterServer, place_servers

__all__ = ["ServerGroups", "split_servers", "AsyncOuter"]


@dataclass
class ServerGroups:
    """Who serves and who trains: world, the server ranks, the workers (every other rank,
    in order), and on a worker its Groups (made among the workers; None on a server);
    count: the number of groups."""
    world: Communicator
    server_ranks: list
    workers: list
    groups: Groups | None
    count: int

    @property
    def is_server(self) -> bool:
        return self.groups is None


def split_servers(comm=None, servers: int = 1, group_size: int = 0) -> ServerGroups:
    """Collective: place `servers` parameter-server ranks (mpidist.ps.place_servers, the
    placement the ParameterServer makes) and split the other ranks into groups."""
    world = as_communicator(comm)
    if world.size < 2:
        raise ValueError("asynchronous DiLoCo needs a parameter-server rank and a worker: "
                         "run on 2 ranks or more")
    nodes = world.comm.allgather(world.node)
    server_ranks = place_servers(nodes, servers)
    workers = [r for r in range(world.size) if r not in server_ranks]
    count = max(group_colors([nodes[r] for r in workers], group_size)) + 1
    is_server = world.rank in server_ranks
    side = world.split(color=int(is_server), key=world.rank)
    groups = None if is_server else make_groups(side, group_size)
    return ServerGroups(world, server_ranks, workers, groups, count)


class AsyncOuter:
    """theta_outer on the server ranks, and each group's rounds (the module docstring).

    params: this rank's flat float32 parameter buffer (servers too: the initial
      theta_outer; NumPy, or CuPy on workers), updated in place; layout: its Layout;
    topo: split_servers(...); rounds: the budget of rounds, all groups together;
    lr, momentum, delay: the delayed Nesterov outer step (delay 0: the number of groups);
    timeout: seconds any wait on the servers may last.
    Construction is collective over topo.world: everyone starts from world rank 0's params.
    """

    def __init__(self, params, layout, topo: ServerGroups, *, rounds: int, lr: float = 0.7,
                 momentum: float = 0.9, delay: int = 0, timeout: float = 300.0):
        world, self.topo, self.layout = topo.world, topo, layout
        self.rounds = int(rounds)
        self.delay = int(delay) or topo.count
        buf = world.to_mpi(params)
        world.comm.Bcast(buf, root=0)
        world.from_mpi(buf, params)
        host = np.ascontiguousarray(to_numpy(params), dtype=np.float32)
        self.ps = ParameterServer(
            host, comm=world, servers=len(topo.server_ranks), consistency="asp", average=False,
            optimizer=lambda off, cnt: DelayedNesterov(off, cnt, lr=lr, momentum=momentum, delay=self.delay),
            timeout=timeout)
        self.counter = SharedCounter(world.comm, host=topo.server_ranks[0])
        g = topo.groups
        self.start = None if g is None else params.copy()    # theta_outer this round started from
        # each push weighs 1 / delay on the server: scale by the group's share of the workers
        self.weight = 0.0 if g is None else topo.count * g.group.size / len(topo.workers)
        if g is not None and not g.is_leader:
            self.ps.worker.finish()       # only leaders push; the servers wait for nobody else
        self.round = -1                   # the round my group is on (-1: none claimed yet)
        self.pushes = 0                   # rounds my group pushed
        self.done = False                 # my group is out of rounds
        self.t_comm = 0.0                 # seconds in push, claim and pull (this rank)

    @property
    def is_server(self) -> bool:
        return self.topo.is_server

    def begin(self, params) -> bool:
        """Collective over my group: claim the next round and start it from the current
        theta_outer (into params). False when the budget is spent: then params holds the
        final theta_outer, once every group's last push is applied."""
        g, worker = self.topo.groups, self.ps.worker
        t0 = time.perf_counter()
        claim = np.zeros(1, np.int64)
        if g.is_leader:
            claim[0] = self.counter.add(1)
            if claim[0] < self.rounds:
                worker.pull(out=params)
            else:
                worker.finish()
                worker.pull_final(out=params)
        if g.group.size > 1:
            g.group.comm.Bcast(claim, root=0)
            buf = g.group.to_mpi(params)
            g.group.comm.Bcast(buf, root=0)
            g.group.from_mpi(buf, params)
        self.round = int(claim[0])
        self.done = self.round >= self.rounds
        self.start[...] = params
        self.t_comm += time.perf_counter() - t0
        return not self.done

    def sync(self, params) -> bool:
        """Collective over my group, after its H inner steps: push the outer gradient, wait
        for the servers to apply it, then begin() the next round (its result)."""
        t0 = time.perf_counter()
        if self.topo.groups.is_leader:
            xp = get_array_module(params)
            delta = xp.subtract(self.start, params)
            delta *= self.weight
            self.ps.worker.push(delta)
            self.ps.worker.wait_applied()
        self.pushes += 1
        self.t_comm += time.perf_counter() - t0
        return self.begin(params)

    def serve(self):
        """On a server: apply pushes until every group has stopped (ServerStats)."""
        return self.ps.serve()

    def finalize(self, params) -> None:
        """Collective over the world, once every group has stopped: the final theta_outer
        into params on every rank (the servers' shards)."""
        final = self.ps.parameters()
        xp = get_array_module(params)
        params[...] = xp.asarray(final, dtype=params.dtype)

    def restore(self, theta: np.ndarray, rounds_done: int) -> None:
        """Collective over the world, before any round: publish theta as theta_outer (the
        servers' shards) with rounds_done of the budget spent."""
        if self.topo.world.rank == self.topo.server_ranks[0]:
            self.counter.set(rounds_done)
        shard = None
        if self.is_server:
            off, cnt = self.ps.shards[self.topo.server_ranks.index(self.topo.world.rank)]
            shard = np.asarray(theta[off:off + cnt], np.float32)
        self.ps.restore(np.zeros(self.ps.num_workers, np.int64), 0, shard)   # also a barrier
        g = self.topo.groups
        if g is not None and not g.is_leader:
            self.ps.worker.finish()       # restore() reopened every worker

    def report(self) -> dict:
        """Collective over the world: {"rounds": pushes per group, "t_comm": each group
        leader's seconds in push, claim and pull, "groups": the number of groups}."""
        g = self.topo.groups
        mine = (g.index, self.pushes, self.t_comm) if g is not None and g.is_leader else None
        every = sorted(m for m in self.topo.world.comm.allgather(mine) if m is not None)
        return {"groups": self.topo.count, "rounds": [p for _, p, _ in every],
                "t_comm": [t for _, _, t in every]}

    def abort(self) -> None:
        """Tell every other rank this one failed (their waits raise at once)."""
        self.ps.abort()

    def close(self) -> None:
        """Collective: free the windows (idempotent)."""
        self.ps.close()
        self.counter.free()
