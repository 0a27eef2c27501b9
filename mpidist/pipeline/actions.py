"""The vocabulary of pipeline schedules: actions, a schedule's per-rank programs, and the
rules that tie a compute action to the transfers around it.

Each rank's program is a list of

  Action("F", i, s)        forward of micro-batch i through virtual stage s
  Action("B", i, s)        backward of micro-batch i through virtual stage s
  Action("RECV_F", i, s)   post the receive of F(i, s)'s input activation (from s - 1's rank)
  Action("SEND_F", i, s)   send F(i, s)'s output activation to s + 1's rank
  Action("RECV_B", i, s)   post the receive of B(i, s)'s output gradient (from s + 1's rank)
  Action("SEND_B", i, s)   send B(i, s)'s input gradient to s - 1's rank
  None                     a bubble: one compute step of idling

Pure: no MPI, no arrays. See docs/ARCHITECTURE.md (pipeline).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Action", "Schedule", "FORWARD", "BACKWARD", "SEND_F", "RECV_F", "SEND_B", "RECV_B",
           "COMPUTE", "TRANSFERS", "dependencies", "transfer_before", "transfer_after", "matching"]

FORWARD, BACKWARD = "F", "B"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (FORWARD, BACKWARD)
TRANSFERS = (SEND_F, RECV_F, SEND_B, RECV_B)


class Action(NamedTuple):
    """One step of a rank's program: kind, micro-batch, virtual stage."""
    kind: str
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.stage}"


@dataclass(frozen=True)
class Schedule:
    """Per-rank programs of one pipeline step, with the bound on stashed activations.

    bound[r]: the most forwards rank r may have run whose backward has not run yet,
    counted in micro-batch chunks (one micro-batch through one virtual stage).
    """
    name: str
    pp: int
    microbatches: int
    virtual: int
    programs: tuple[tuple[Action | None, ...], ...]
    bound: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def local_stages(self, rank: int) -> list[int]:
        return list(range(rank, self.num_stages, self.pp))

    def slots(self, rank: int) -> list[Action | None]:
        """The rank's compute steps and bubbles, one per step of the grid."""
        return [a for a in self.programs[rank] if a is None or a.kind in COMPUTE]

    def peer(self, action: Action) -> int:
        """The rank a transfer action talks to."""
        if action.kind in (RECV_F, SEND_B):
            return self.rank_of(action.stage - 1)
        if action.kind in (SEND_F, RECV_B):
            return self.rank_of(action.stage + 1)
        raise ValueError(f"{action} is not a transfer")


def dependencies(a: Action, num_stages: int) -> list[Action]:
    """The compute actions that must finish before `a` can start."""
    i, s = a.microbatch, a.stage
    if a.kind == FORWARD:
        return [Action(FORWARD, i, s - 1)] if s > 0 else []
    deps = [Action(FORWARD, i, s)]
    if s < num_stages - 1:
        deps.append(Action(BACKWARD, i, s + 1))
    return deps


def transfer_before(a: Action, pp: int, num_stages: int) -> Action | None:
    """The receive that compute action `a` needs posted first (None: input is local)."""
    if pp == 1:
        return None
    if a.kind == FORWARD and a.stage > 0:
        return Action(RECV_F, a.microbatch, a.stage)
    if a.kind == BACKWARD and a.stage < num_stages - 1:
        return Action(RECV_B, a.microbatch, a.stage)
    return None


def transfer_after(a: Action, pp: int, num_stages: int) -> Action | None:
    """The send that follows compute action `a` (None: the consumer is local)."""
    if pp == 1:
        return None
    if a.kind == FORWARD and a.stage < num_stages - 1:
        return Action(SEND_F, a.microbatch, a.stage)
    if a.kind == BACKWARD and a.stage > 0:
        return Action(SEND_B, a.microbatch, a.stage)
    return None


def matching(a: Action) -> Action:
    """The peer's transfer that completes transfer `a`."""
    i, s = a.microbatch, a.stage
    return {SEND_F: Action(RECV_F, i, s + 1), RECV_F: Action(SEND_F, i, s - 1),
            SEND_B: Action(RECV_B, i, s - 1), RECV_B: Action(SEND_B, i, s + 1)}[a.kind]
