"""Worker groups for DiLoCo and local SGD: data parallel inside a group, outer steps across.

A group is a node by default (the communicator's node split: MPI's shared-memory split, or
MPIDIST_RANKS_PER_NODE's simulated nodes), or runs of `group_size` consecutive ranks (the
last one may be smaller), or given rank by rank (`colors`: after a lost rank, the survivors
stay in the groups they were in). The fast links are inside a group; only the outer exchange,
once every H steps, crosses between groups, and only one rank per group (its leader) takes
part in it (Douillard et al. 2023, DiLoCo: one "worker" per island of accelerators).
"""
from __future__ import annotations

from dataclasses import dataclass

from mpidist.checks import positive_int
from mpidist.comm import Communicator, as_communicator

__all__ = ["Groups", "make_groups", "group_colors"]


def group_colors(nodes: list[int], group_size: int) -> list[int]:
    """Each rank's group number, dense in order of the group's lowest rank (pure).

    nodes: the node of every rank; group_size: 0 = one group per node, else runs of
    group_size consecutive ranks.
    """
    raw = list(nodes) if group_size == 0 else [r // group_size for r in range(len(nodes))]
    order = sorted(set(raw), key=raw.index)
    return [order.index(c) for c in raw]


@dataclass
class Groups:
    """The group topology seen from one rank.

    world: the whole job's communicator; group: my group's ranks (data parallel inside);
    leaders: group rank 0 of every group, ordered by group (on other ranks: the
    communicator of the non-leaders, never used); index, count: my group and how many;
    members: the world ranks of my group, in group-rank order.
    """
    world: Communicator
    group: Communicator
    leaders: Communicator
    index: int
    count: int
    members: tuple

    @property
    def is_leader(self) -> bool:
        return self.group.rank == 0


def make_groups(comm=None, group_size: int = 0, colors=None) -> Groups:
    """Collective: split comm into DiLoCo groups (see the module docstring).

    colors: the group of every rank of comm, any numbers (the same list on every rank);
    given, it replaces group_size's rule.
    """
    if group_size != 0:
        group_size = positive_int("group_size", group_size)
    world = as_communicator(comm)
    if colors:
        if len(colors) != world.size:
            raise ValueError(f"colors must give the group of each of the {world.size} ranks, got {len(colors)}")
        colors = group_colors(list(colors), 0)
    else:
        colors = group_colors(world.comm.allgather(world.node), group_size)
    index = colors[world.rank]
    group = world.split(color=index, key=world.rank)
    leaders = world.split(color=0 if group.rank == 0 else 1, key=index)
    members = tuple(r for r in range(world.size) if colors[r] == index)
    return Groups(world, group, leaders, index, max(colors) + 1, members)
