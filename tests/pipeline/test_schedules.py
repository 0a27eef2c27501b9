"""Pipeline schedules as pure data: checked without MPI for many (pp, micro-batches, virtual)."""
import dataclasses

import pytest

from mpidist.pipeline.actions import BACKWARD, FORWARD, RECV_F, SEND_F, Action
from mpidist.pipeline.schedules import (build_schedule, format_grid, gpipe, ideal_bubble,
                                        interleaved_1f1b, one_f_one_b)
from mpidist.pipeline.rules import validate

PM = [(p, m) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 5, 8, 16)]


def _grid_bubble(schedule):
    """Bubble fraction of the ideal grid: idle steps / all steps, averaged over ranks."""
    slots = [schedule.slots(r) for r in range(schedule.pp)]
    return sum(s.count(None) for s in slots) / sum(len(s) for s in slots)


def test_gpipe_and_1f1b_rules_for_many_sizes():
    for p, m in PM:
        g, f = gpipe(p, m), one_f_one_b(p, m)
        sg, sf = validate(g), validate(f)
        assert sg["peak_in_flight"] == [m] * p                        # GPipe stashes all m
        assert sf["peak_in_flight"] == [min(p - r, m) for r in range(p)]
        assert max(sf["peak_in_flight"]) <= p                        # 1F1B: at most p
        # both have the ideal bubble: 2(p - 1) idle steps per rank of 2(m + p - 1)
        assert sg["bubbles"] == sf["bubbles"] == [2 * (p - 1)] * p
        assert _grid_bubble(g) == pytest.approx(ideal_bubble(p, m))
        assert _grid_bubble(f) == pytest.approx(ideal_bubble(p, m))


def test_interleaved_rules_for_many_sizes():
    for p, m in PM:
        for v in (1, 2, 3, 4):
            s = interleaved_1f1b(p, m, v)
            stats = validate(s)
            # in chunks of 1/v of a stage: at most p micro-batches' worth stashed
            assert max(stats["peak_in_flight"]) <= p * v
            if m % p == 0:      # full groups: the bubble shrinks by v
                assert stats["bubbles"] == [2 * (p - 1)] * p
                assert _grid_bubble(s) == pytest.approx(ideal_bubble(p, m, v))


def test_interleaved_with_one_chunk_is_1f1b():
    for p, m in PM:
        assert interleaved_1f1b(p, m, 1).programs == one_f_one_b(p, m).programs


def test_every_forward_precedes_its_backward_and_sends_match_receives_in_order():
    s = build_schedule("interleaved", 3, 6, 2)
    sends, recvs = {}, {}
    for r, program in enumerate(s.programs):
        done = set()
        for a in program:
            if a is None:
                continue
            if a.kind == BACKWARD:
                assert Action(FORWARD, a.microbatch, a.stage) in done
            done.add(a)
            if a.kind == SEND_F:
                sends.setdefault((r, s.peer(a), a.stage), []).append(a.microbatch)
            if a.kind == RECV_F:
                recvs.setdefault((s.peer(a), r, a.stage - 1), []).append(a.microbatch)
    assert sends == recvs and sends


def test_programs_place_receives_ahead_of_their_compute():
    program = one_f_one_b(3, 4).programs[1]
    first_f = program.index(Action(FORWARD, 0, 1))
    assert Action(RECV_F, 0, 1) in program[:first_f]
    assert program[first_f + 1] == Action(SEND_F, 0, 1)
    assert None in program                   # bubbles are part of the program


def _replace(schedule, rank, program):
    programs = list(schedule.programs)
    programs[rank] = tuple(program)
    return dataclasses.replace(schedule, programs=tuple(programs))


def test_validate_rejects_backward_before_forward():
    s = gpipe(2, 2)
    prog = [a for a in s.programs[1] if a is not None]
    f, b = prog.index(Action(FORWARD, 1, 1)), prog.index(Action(BACKWARD, 1, 1))
    prog[f], prog[b] = prog[b], prog[f]
    with pytest.raises(ValueError, match="before its forward"):
        validate(_replace(s, 1, prog))


def test_validate_rejects_a_missing_receive():
    s = one_f_one_b(2, 3)
    prog = [a for a in s.programs[1] if a != Action(RECV_F, 2, 1)]
    with pytest.raises(ValueError, match="without posting"):
        validate(_replace(s, 1, prog))


def test_validate_rejects_receives_out_of_send_order():
    s = gpipe(2, 3)
    prog = list(s.programs[1])
    i, j = prog.index(Action(RECV_F, 1, 1)), prog.index(Action(RECV_F, 2, 1))
    prog[i], prog[j] = prog[j], prog[i]
    with pytest.raises(ValueError, match="receives"):
        validate(_replace(s, 1, prog))


def test_validate_detects_deadlock():
    # rank 0 waits for B0 before sending F1; rank 1 runs F1 before it sends B0: a cycle
    A = Action
    s = one_f_one_b(2, 2)
    r0 = [A("F", 0, 0), A("SEND_F", 0, 0), A("RECV_B", 0, 0), A("B", 0, 0),
          A("F", 1, 0), A("SEND_F", 1, 0), A("RECV_B", 1, 0), A("B", 1, 0)]
    r1 = [A("RECV_F", 0, 1), A("F", 0, 1), A("RECV_F", 1, 1), A("F", 1, 1),
          A("B", 0, 1), A("SEND_B", 0, 1), A("B", 1, 1), A("SEND_B", 1, 1)]
    with pytest.raises(ValueError, match="deadlock"):
        validate(_replace(_replace(s, 0, r0), 1, r1))


def test_validate_enforces_the_in_flight_bound():
    s = dataclasses.replace(gpipe(3, 4), bound=(3, 4, 4))
    with pytest.raises(ValueError, match="above the bound"):
        validate(s)


def test_format_grid_is_a_step_by_rank_table():
    s = one_f_one_b(2, 3)
    text = format_grid(s)
    lines = text.splitlines()
    assert lines[0].startswith("1f1b: pp=2 microbatches=3")
    assert lines[1].split() == ["step", "r0", "r1"]
    assert len(lines) == 2 + len(s.slots(0))
    assert lines[2].split() == ["0", "F0", "."]
    assert "F2.1" in format_grid(interleaved_1f1b(2, 4, 2))


def test_build_schedule_rejects_bad_input():
    with pytest.raises(ValueError, match="choose one of"):
        build_schedule("zigzag", 2, 4)
    with pytest.raises(ValueError, match="interleaved"):
        build_schedule("1f1b", 2, 4, virtual=2)
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        build_schedule("gpipe", 2, 0)
    with pytest.raises(TypeError):
        build_schedule("gpipe", 2.0, 4)
