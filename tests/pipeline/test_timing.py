"""timing.replay without MPI: programs of real schedules with chosen compute times."""
import pytest

from mpidist.pipeline.actions import COMPUTE
from mpidist.pipeline.schedules import build_schedule, ideal_bubble
from mpidist.pipeline.timing import replay


def events(schedule, tf=1.0, tb=2.0, slow=None, factor=1.0):
    """Every rank's computes in program order, back to back (replay ignores the times
    of day, only durations count); `slow` = (kind, microbatch, stage) takes `factor` x."""
    out = []
    for program in schedule.programs:
        t, ev = 0.0, []
        for a in program:
            if a is None or a.kind not in COMPUTE:
                continue
            d = (tf if a.kind == "F" else tb) * (factor if (a.kind, a.microbatch, a.stage) == slow else 1)
            ev.append((a.kind, a.microbatch, a.stage, t, t + d))
            t += d
        out.append(ev)
    return out


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 2, 4, 1), ("1f1b", 2, 8, 1), ("1f1b", 4, 16, 1),
                                        ("gpipe", 3, 5, 1), ("interleaved", 2, 4, 2)])
def test_uniform_compute_replays_to_the_ideal_bubble(name, p, m, v):
    got = replay(events(build_schedule(name, p, m, v), tf=1.0, tb=1.0))
    assert got["bubble"] == pytest.approx(ideal_bubble(p, m, v))
    assert got["bubble_busiest"] == pytest.approx(ideal_bubble(p, m, v))
    assert got["makespan"] == pytest.approx(2 * (v * m + p - 1))     # per-chunk times of 1


def test_backward_twice_the_forward_keeps_the_ideal_for_1f1b():
    got = replay(events(build_schedule("1f1b", 2, 8), tf=1.0, tb=2.0))
    assert got["bubble"] == pytest.approx(ideal_bubble(2, 8))


def test_one_slow_compute_holds_up_the_pipeline():
    schedule = build_schedule("1f1b", 2, 8)
    base = replay(events(schedule))
    slowed = replay(events(schedule, slow=("F", 3, 0), factor=3.0))
    assert slowed["makespan"] == pytest.approx(base["makespan"] + 2.0)   # F3 on stage 0: +2
    assert slowed["bubble"] > base["bubble"]


def test_a_compute_whose_input_never_ran_is_an_error():
    ev = events(build_schedule("1f1b", 2, 4))
    ev[0] = [e for e in ev[0] if (e[0], e[1]) != ("F", 2)]        # stage 0 never runs F2
    with pytest.raises(ValueError, match="never ran"):
        replay(ev)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_a_faster_stage_waits_but_the_busiest_rank_keeps_the_ideal(name):
    """Stage 0 computes 10% faster than stage 1: its wait for stage 1 grows with m and
    lifts the mean bubble, while the busiest rank's idle stays within the fill and drain."""
    m, p = 16, 2
    ev = events(build_schedule(name, p, m))
    ev[0] = [(k, i, s, 0.9 * t0, 0.9 * t1) for k, i, s, t0, t1 in ev[0]]
    got = replay(ev)
    ideal = ideal_bubble(p, m)
    assert got["bubble"] > 1.5 * ideal
    assert 0.85 * ideal < got["bubble_busiest"] <= ideal
