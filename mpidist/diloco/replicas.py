"""What one rank of a DiLoCo job holds, as a replica after a lost rank (mpidist.ft's
"groups" route): the outer part (theta_outer, its momentum, the fragments' round starts),
the same on every rank after a sync, and the inner part, its group's own: tensors under
INNER_PREFIX and the scalars INNER_SCALARS. A recovery takes the outer part from the
newest sync any survivor completed and the inner part from the group's newest member."""
from __future__ import annotations

from mpidist.state import InMemoryState

__all__ = ["INNER_PREFIX", "INNER_SCALARS", "replica_versions", "combine_replicas"]

INNER_PREFIX = "diloco/"
INNER_SCALARS = ("optim_step", "optim", "optim_extra", "inner_step", "inner_round_starts", "diloco_group")


def replica_versions(state) -> tuple[int, int]:
    """(outer, inner) of a replica (replica_state_dict's, or combine_replicas'): how far
    its theta_outer is (the sum of the fragments' last sync steps: syncs come in one order
    everywhere, so equal sums are equal syncs) and its group's inner steps."""
    return sum(state.scalars["round_starts"]), int(state.scalars["inner_step"])


def combine_replicas(step: int, outer, inner, group: list[int]) -> InMemoryState:
    """One rank's state after a recovery: theta_outer and its momentum from replica `outer`,
    the inner state from replica `inner` (its group's newest), at loop step `step`, for
    group [index, count]; load_state_dict restarts from theta_outer the fragments synced
    since `inner` was taken."""
    tensors = {k: v for k, v in outer.tensors.items() if not k.startswith(INNER_PREFIX)}
    tensors.update((k, v) for k, v in inner.tensors.items() if k.startswith(INNER_PREFIX))
    scalars = {**outer.scalars, **{k: inner.scalars[k] for k in INNER_SCALARS if k in inner.scalars}}
    scalars["diloco_group"] = list(group)
    return InMemoryState(step, tensors, scalars)
