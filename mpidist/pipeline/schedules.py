"""Pipeline schedules as data: GPipe, 1F1B and interleaved 1F1B, one program per rank.

A model cut into S = pp * virtual stages runs on pp ranks; virtual stage s lives on rank
s % pp. Each rank's program is a list of actions (pipeline.actions). Each compute action
takes one step of the step x rank grid (`format_grid`), placed where an ideal run with equal
step times would run it; receives are posted one compute action ahead, so a transfer
overlaps the compute before it. Transfers between two stages on the same rank (pp == 1) are
local hand-offs, not actions. Pure functions: `pipeline.rules.validate` checks a schedule,
the executor runs it. See docs/ARCHITECTURE.md (pipeline).
"""
from __future__ import annotations

from typing import Callable

from mpidist.pipeline.actions import (BACKWARD, COMPUTE, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F,
                                      TRANSFERS, Action, Schedule, dependencies, transfer_after,
                                      transfer_before)

__all__ = ["Action", "Schedule", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "PIPELINE_SCHEDULES", "build_schedule", "format_grid", "ideal_bubble",
           "FORWARD", "BACKWARD", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "COMPUTE", "TRANSFERS"]


# ----------------------------------------------------------------------- compute orders
def _check_sizes(pp: int, microbatches: int, virtual: int) -> None:
    for what, n in (("pp", pp), ("microbatches", microbatches), ("virtual", virtual)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{what} must be an int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"{what} must be >= 1, got {n}")


def _gpipe_order(pp: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards (in reverse, so the last stash is freed first)."""
    return ([Action(FORWARD, i, rank) for i in range(m)]
            + [Action(BACKWARD, i, rank) for i in reversed(range(m))])


def _one_f_one_b_order(pp: int, m: int, rank: int) -> list[Action]:
    """Warm-up forwards, then one forward / one backward, then the remaining backwards.

    Rank r runs pp - r - 1 warm-up forwards, so at most pp - r activations are stashed.
    """
    warmup = min(pp - rank - 1, m)
    order = [Action(FORWARD, i, rank) for i in range(warmup)]
    for k in range(m - warmup):
        order += [Action(FORWARD, warmup + k, rank), Action(BACKWARD, k, rank)]
    order += [Action(BACKWARD, i, rank) for i in range(m - warmup, m)]
    return order


def _interleaved_sequence(pp: int, m: int, v: int, rank: int, backward: bool) -> list[Action]:
    """Micro-batches in groups of pp; each group runs through every chunk before the next
    group starts (chunks in order for forwards, reversed for backwards)."""
    kind = BACKWARD if backward else FORWARD
    chunks = range(v - 1, -1, -1) if backward else range(v)
    seq = []
    for g in range(0, m, pp):
        for c in chunks:
            seq += [Action(kind, i, c * pp + rank) for i in range(g, min(g + pp, m))]
    return seq


def _interleaved_warmup(pp: int, m: int, v: int, rank: int) -> int:
    """Rank r runs its first chunk's warm-up like 1F1B, plus one group per extra chunk,
    so at most (pp - r) + (v - 1) pp chunks, i.e. pp micro-batches' worth, are stashed."""
    return min(m * v, (pp - rank - 1) + (v - 1) * pp)


def _interleaved_order(pp: int, m: int, v: int, rank: int) -> list[Action]:
    """1F1B over virtual stages: warm-up forwards, then alternate, then the backwards."""
    fwd = _interleaved_sequence(pp, m, v, rank, backward=False)
    bwd = _interleaved_sequence(pp, m, v, rank, backward=True)
    warmup = _interleaved_warmup(pp, m, v, rank)
    order = fwd[:warmup]
    for k in range(len(fwd) - warmup):
        order += [fwd[warmup + k], bwd[k]]
    return order + bwd[len(fwd) - warmup:]


# ----------------------------------------------------------------------- placement
def _place(orders: list[list[Action]], num_stages: int) -> list[list[Action | None]]:
    """Run the per-rank orders on a grid of equal steps: at each step a rank runs its
    next action if everything it needs finished at an earlier step, else idles."""
    done: dict[Action, int] = {}
    slots: list[list[Action | None]] = [[] for _ in orders]
    pos = [0] * len(orders)
    step = 0
    while any(p < len(o) for p, o in zip(pos, orders)):
        progressed = False
        for r, order in enumerate(orders):
            if pos[r] < len(order) and all(done.get(d, step) < step
                                           for d in dependencies(order[pos[r]], num_stages)):
                slots[r].append(order[pos[r]])
                done[order[pos[r]]] = step
                pos[r] += 1
                progressed = True
            else:
                slots[r].append(None)
        if not progressed:
            stuck = {r: str(o[p]) for r, (o, p) in enumerate(zip(orders, pos)) if p < len(o)}
            raise RuntimeError(f"compute orders deadlock at step {step}: waiting {stuck}")
        step += 1
    return slots


def _with_transfers(slots: list[Action | None], pp: int, num_stages: int
                    ) -> tuple[Action | None, ...]:
    """Insert receives (one compute action ahead) and sends (right after) into a rank's
    slots."""
    computes = [a for a in slots if a is not None]
    program: list[Action | None] = []
    if computes and (first := transfer_before(computes[0], pp, num_stages)):
        program.append(first)
    k = 0
    for a in slots:
        if a is None:
            program.append(None)
            continue
        if k + 1 < len(computes) and (nxt := transfer_before(computes[k + 1], pp, num_stages)):
            program.append(nxt)
        program.append(a)
        if (send := transfer_after(a, pp, num_stages)):
            program.append(send)
        k += 1
    return tuple(program)


def _make(name: str, pp: int, m: int, v: int,
          order: Callable[[int], list[Action]], bound: Callable[[int], int]) -> Schedule:
    orders = [order(r) for r in range(pp)]
    slots = _place(orders, pp * v)
    programs = tuple(_with_transfers(s, pp, pp * v) for s in slots)
    return Schedule(name, pp, m, v, programs, tuple(bound(r) for r in range(pp)))


# ----------------------------------------------------------------------- public schedules
def gpipe(pp: int, microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward; all m activations stashed."""
    _check_sizes(pp, microbatches, 1)
    return _make("gpipe", pp, microbatches, 1,
                 lambda r: _gpipe_order(pp, microbatches, r), lambda r: microbatches)


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): same bubble as GPipe, at most pp - r activations stashed."""
    _check_sizes(pp, microbatches, 1)
    return _make("1f1b", pp, microbatches, 1,
                 lambda r: _one_f_one_b_order(pp, microbatches, r),
                 lambda r: min(pp - r, microbatches))


def interleaved_1f1b(pp: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Interleaved 1F1B: `virtual` model chunks per rank cut the bubble by that factor.

    Micro-batches go through the chunks in groups of pp, so the bubble is smallest when
    pp divides the micro-batch count.
    """
    _check_sizes(pp, microbatches, virtual)
    return _make("interleaved", pp, microbatches, virtual,
                 lambda r: _interleaved_order(pp, microbatches, virtual, r),
                 lambda r: min(microbatches * virtual,
                               _interleaved_warmup(pp, microbatches, virtual, r) + 1))


PIPELINE_SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
}


def build_schedule(name: str, pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule called `name` ("gpipe", "1f1b", "interleaved")."""
    if name not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of "
                         f"{sorted(PIPELINE_SCHEDULES)}")
    if name == "interleaved":
        return interleaved_1f1b(pp, microbatches, virtual)
    if virtual != 1:
        raise ValueError(f"schedule {name!r} runs one stage per rank (virtual = 1), got "
                         f"virtual = {virtual}; use schedule 'interleaved' for virtual stages")
    return PIPELINE_SCHEDULES[name](pp, microbatches)


def ideal_bubble(pp: int, microbatches: int, virtual: int = 1) -> float:
    """The bubble fraction of an ideal run: (p - 1) / (v m + p - 1)."""
    return (pp - 1) / (virtual * microbatches + pp - 1)


def format_grid(schedule: Schedule) -> str:
    """The step x rank grid of compute actions ('.' is a bubble), one row per step.

    F3 / B3 is micro-batch 3; with virtual stages the chunk follows: F3.1.
    """
    cols = [schedule.slots(r) for r in range(schedule.pp)]
    steps = max(len(c) for c in cols)

    def cell(a: Action | None) -> str:
        if a is None:
            return "."
        chunk = f".{a.stage // schedule.pp}" if schedule.virtual > 1 else ""
        return f"{a.kind}{a.microbatch}{chunk}"

    width = max(6, max((len(cell(a)) for c in cols for a in c), default=1) + 1)
    head = "step " + "".join(f"{'r' + str(r):>{width}}" for r in range(schedule.pp))
    rows = [head]
    for t in range(steps):
        rows.append(f"{t:>4} " + "".join(
            f"{cell(c[t]) if t < len(c) else '':>{width}}" for c in cols))
    title = (f"{schedule.name}: pp={schedule.pp} microbatches={schedule.microbatches} "
             f"virtual={schedule.virtual}")
    return "\n".join([title] + rows)
