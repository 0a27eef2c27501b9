"""Checks of a pipeline schedule's rules, without MPI: what the executor relies on.

`validate` checks that every forward comes before its backward, every transfer is matched by
its peer in the same order, the programs run to completion with nonblocking transfers (no
deadlock), and stashed activations stay within the schedule's bound.
See docs/ARCHITECTURE.md (pipeline).
"""
from __future__ import annotations

from mpidist.pipeline.actions import (BACKWARD, COMPUTE, FORWARD, RECV_F, SEND_B, SEND_F,
                                      TRANSFERS, Action, Schedule, dependencies, matching,
                                      transfer_after, transfer_before)

__all__ = ["validate", "simulate"]


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
                before = transfer_before(a, pp, S)
                if before is not None and before not in seen:
                    raise ValueError(f"rank {r} runs {a} without posting {before} first")
            elif a.kind in (SEND_F, SEND_B):
                producer = Action(FORWARD if a.kind == SEND_F else BACKWARD, a.microbatch, a.stage)
                if producer not in seen or transfer_after(producer, pp, S) != a:
                    raise ValueError(f"rank {r} runs {a} before {producer} or without need")
            elif transfer_before(Action(FORWARD if a.kind == RECV_F else BACKWARD,
                                          a.microbatch, a.stage), pp, S) != a:
                raise ValueError(f"rank {r} posts {a}, which no compute needs")
            if a.kind in TRANSFERS:
                peer = schedule.peer(a)
                sender, receiver = (r, peer) if a.kind.startswith("SEND") else (peer, r)
                stage = a.stage if a.kind.startswith("SEND") else matching(a).stage
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
    peaks = simulate(schedule)
    for r, (peak, bound) in enumerate(zip(peaks, schedule.bound)):
        if peak > bound:
            raise ValueError(f"rank {r} stashes {peak} activations, above the bound {bound}")
    return {"peak_in_flight": peaks,
            "bubbles": [schedule.slots(r).count(None) for r in range(pp)]}


def simulate(schedule: Schedule) -> list[int]:
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
                    needed = [d for d in dependencies(a, S) if schedule.rank_of(d.stage) == r]
                    recv = transfer_before(a, pp, S)
                    if recv is not None:
                        needed.append(matching(recv))
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
