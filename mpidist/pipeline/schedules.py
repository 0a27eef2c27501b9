"""Pipeline schedules as data: for each rank, an ordered list of actions.

A model cut into S = pp * virtual stages runs on pp ranks; virtual stage s lives on rank
s % pp (with virtual = 1 a rank holds one stage; with virtual = v it holds the chunks
r, r + pp, r + 2 pp, ... of the interleaved schedule). Each rank's program is a list of

  Action("F", i, s)        forward of micro-batch i through virtual stage s
  Action("B", i, s)        backward of micro-batch i through virtual stage s
  Action("RECV_F", i, s)   post the receive of F(i, s)'s input activation (from s - 1's rank)
  Action("SEND_F", i, s)   send F(i, s)'s output activation to s + 1's rank
  Action("RECV_B", i, s)   post the receive of B(i, s)'s output gradient (from s + 1's rank)
  Action("SEND_B", i, s)   send B(i, s)'s input gradient to s - 1's rank
  None                     a bubble: one compute step of idling

Each compute action takes one step of the step x rank grid (`format_grid`), placed where
an ideal run with equal step times would run it. Receives are posted one compute action
ahead, so a transfer overlaps the compute before it. Transfers between two stages on the
same rank (only when pp == 1) are local hand-offs, not actions.

The functions here are pure: no MPI, no arrays. `validate` checks a schedule's rules
(every forward before its backward, every transfer matched by its peer in order, no
deadlock, in-flight activations within the schedule's bound); the executor runs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

__all__ = ["Action", "Schedule", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "SCHEDULES", "build_schedule", "validate", "format_grid", "ideal_bubble",
           "FORWARD", "BACKWARD", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]

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
def _dependencies(a: Action, num_stages: int) -> list[Action]:
    """The compute actions that must finish before `a` can start."""
    i, s = a.microbatch, a.stage
    if a.kind == FORWARD:
        return [Action(FORWARD, i, s - 1)] if s > 0 else []
    deps = [Action(FORWARD, i, s)]
    if s < num_stages - 1:
        deps.append(Action(BACKWARD, i, s + 1))
    return deps


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
                                           for d in _dependencies(order[pos[r]], num_stages)):
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


def _transfer_before(a: Action, pp: int, num_stages: int) -> Action | None:
    """The receive that compute action `a` needs posted first (None: input is local)."""
    if pp == 1:
        return None
    if a.kind == FORWARD and a.stage > 0:
        return Action(RECV_F, a.microbatch, a.stage)
    if a.kind == BACKWARD and a.stage < num_stages - 1:
        return Action(RECV_B, a.microbatch, a.stage)
    return None


def _transfer_after(a: Action, pp: int, num_stages: int) -> Action | None:
    """The send that follows compute action `a` (None: the consumer is local)."""
    if pp == 1:
        return None
    if a.kind == FORWARD and a.stage < num_stages - 1:
        return Action(SEND_F, a.microbatch, a.stage)
    if a.kind == BACKWARD and a.stage > 0:
        return Action(SEND_B, a.microbatch, a.stage)
    return None


def _with_transfers(slots: list[Action | None], pp: int, num_stages: int
                    ) -> tuple[Action | None, ...]:
    """Insert receives (one compute action ahead) and sends (right after) into a rank's
    slots."""
    computes = [a for a in slots if a is not None]
    program: list[Action | None] = []
    if computes and (first := _transfer_before(computes[0], pp, num_stages)):
        program.append(first)
    k = 0
    for a in slots:
        if a is None:
            program.append(None)
            continue
        if k + 1 < len(computes) and (nxt := _transfer_before(computes[k + 1], pp, num_stages)):
            program.append(nxt)
        program.append(a)
        if (send := _transfer_after(a, pp, num_stages)):
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


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
}


def build_schedule(name: str, pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule called `name` ("gpipe", "1f1b", "interleaved")."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if name == "interleaved":
        return interleaved_1f1b(pp, microbatches, virtual)
    if virtual != 1:
        raise ValueError(f"schedule {name!r} runs one stage per rank (virtual = 1), got "
                         f"virtual = {virtual}; use schedule 'interleaved' for virtual stages")
    return SCHEDULES[name](pp, microbatches)


def ideal_bubble(pp: int, microbatches: int, virtual: int = 1) -> float:
    """The bubble fraction of an ideal run: (p - 1) / (v m + p - 1)."""
    return (pp - 1) / (virtual * microbatches + pp - 1)


# ----------------------------------------------------------------------- checks
def _matching(a: Action) -> Action:
    """The peer's transfer that completes transfer `a`."""
    i, s = a.microbatch, a.stage
    return {SEND_F: Action(RECV_F, i, s + 1), RECV_F: Action(SEND_F, i, s - 1),
            SEND_B: Action(RECV_B, i, s - 1), RECV_B: Action(SEND_B, i, s + 1)}[a.kind]


def validate(schedule: Schedule) -> dict[str, list[int]]:
    """Check a schedule's rules; raise ValueError naming the first rule broken.

    Rules: each rank runs F and B of every micro-batch on each of its stages exactly once,
    every forward before its backward, a receive before each compute that needs a remote
    input and a send after each that feeds one; sends and receives matched in the same
    order on every (sender, receiver, kind, stage) channel; the programs run to completion
    with nonblocking sends and receives (no deadlock); stashed activations within bound.
    Returns {"peak_in_flight": [...], "bubbles": [...]} per rank.
    """
    pp, m, S = schedule.pp, schedule.microbatches, schedule.num_stages
    if len(schedule.programs) != pp or len(schedule.bound) != pp:
        raise ValueError(f"schedule has {len(schedule.programs)} programs and "
                         f"{len(schedule.bound)} bounds for pp = {pp}")
    channels: dict[tuple, list[int]] = {}
    for r, program in enumerate(schedule.programs):
        mine = set(schedule.local_stages(r))
        seen: set[Action] = set()
        for k, a in enumerate(program):
            if a is None:
                continue
            if a.stage not in mine or not 0 <= a.microbatch < m:
                raise ValueError(f"rank {r} runs {a}, which is not one of its stages "
                                 f"{sorted(mine)} or micro-batches [0, {m})")
            if a in seen:
                raise ValueError(f"rank {r} runs {a} twice")
            seen.add(a)
            if a.kind == BACKWARD and Action(FORWARD, a.microbatch, a.stage) not in seen:
                raise ValueError(f"rank {r} runs {a} before its forward")
            if a.kind in COMPUTE:
                before = _transfer_before(a, pp, S)
                if before is not None and before not in seen:
                    raise ValueError(f"rank {r} runs {a} without posting {before} first")
            elif a.kind in (SEND_F, SEND_B):
                producer = Action(FORWARD if a.kind == SEND_F else BACKWARD, a.microbatch, a.stage)
                if producer not in seen or _transfer_after(producer, pp, S) != a:
                    raise ValueError(f"rank {r} runs {a} before {producer} or without need")
            elif _transfer_before(Action(FORWARD if a.kind == RECV_F else BACKWARD,
                                          a.microbatch, a.stage), pp, S) != a:
                raise ValueError(f"rank {r} posts {a}, which no compute needs")
            if a.kind in TRANSFERS:
                peer = schedule.peer(a)
                sender, receiver = (r, peer) if a.kind.startswith("SEND") else (peer, r)
                stage = a.stage if a.kind.startswith("SEND") else _matching(a).stage
                key = (sender, receiver, a.kind[-1], stage, a.kind.startswith("SEND"))
                channels.setdefault(key, []).append(a.microbatch)
        for s in mine:
            for i in range(m):
                for kind in COMPUTE:
                    if Action(kind, i, s) not in seen:
                        raise ValueError(f"rank {r} never runs {Action(kind, i, s)}")
    for (sender, receiver, kind, stage, is_send), order in channels.items():
        if is_send:
            got = channels.get((sender, receiver, kind, stage, False), [])
            if got != order:
                raise ValueError(f"rank {sender} sends {kind} of stage {stage} to rank "
                                 f"{receiver} for micro-batches {order} but rank {receiver} "
                                 f"receives {got}")
    peaks = _simulate(schedule)
    for r, (peak, bound) in enumerate(zip(peaks, schedule.bound)):
        if peak > bound:
            raise ValueError(f"rank {r} stashes {peak} activations, above the bound {bound}")
    return {"peak_in_flight": peaks,
            "bubbles": [schedule.slots(r).count(None) for r in range(pp)]}


def _simulate(schedule: Schedule) -> list[int]:
    """Run the programs with nonblocking transfers: a compute waits for its input to be
    sent (or computed locally); returns each rank's peak of stashed activations.
    Raises ValueError on deadlock."""
    pp, S = schedule.pp, schedule.num_stages
    programs = [[a for a in p if a is not None] for p in schedule.programs]
    pos = [0] * pp
    done: set[Action] = set()
    in_flight, peaks = [0] * pp, [0] * pp
    while any(p < len(prog) for p, prog in zip(pos, programs)):
        progressed = False
        for r, prog in enumerate(programs):
            while pos[r] < len(prog):
                a = prog[pos[r]]
                if a.kind in COMPUTE:
                    needed = [d for d in _dependencies(a, S) if schedule.rank_of(d.stage) == r]
                    recv = _transfer_before(a, pp, S)
                    if recv is not None:
                        needed.append(_matching(recv))
                    if not all(d in done for d in needed):
                        break
                    in_flight[r] += 1 if a.kind == FORWARD else -1
                    peaks[r] = max(peaks[r], in_flight[r])
                done.add(a)
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(prog[p]) for r, (prog, p) in enumerate(zip(programs, pos))
                     if p < len(prog)}
            raise ValueError(f"schedule {schedule.name} deadlocks: ranks wait at {stuck}")
    return peaks


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
