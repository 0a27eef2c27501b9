"""Backoff: spin, then sleep doubling to a cap; False once past the deadline."""
import types

import pytest

from mpidist import backoff
from mpidist.backoff import Backoff


@pytest.fixture
def clock(monkeypatch):
    """A fake clock: its sleep advances it and records each nap. It replaces the module
    backoff sees as `time`, not the time module itself, whose sleep other threads of the
    process (workers, watchdogs) keep calling meanwhile."""
    state = {"now": 100.0, "naps": []}

    def sleep(seconds):
        state["naps"].append(seconds)
        state["now"] += seconds

    monkeypatch.setattr(backoff, "time", types.SimpleNamespace(
        sleep=sleep, perf_counter=lambda: state["now"]))
    return state


def test_spins_then_sleeps_doubling_to_the_cap(clock):
    wait = Backoff(spins=3, longest=100e-6)
    assert all(wait() for _ in range(8))
    assert clock["naps"] == pytest.approx([20e-6, 40e-6, 80e-6, 100e-6, 100e-6])


def test_the_default_spins_before_the_first_sleep(clock):
    wait = Backoff()
    for _ in range(backoff.SPINS):
        wait()
    assert clock["naps"] == []
    wait()
    assert clock["naps"] == [backoff.FIRST_NAP]


def test_past_the_deadline_it_answers_false_without_sleeping(clock):
    wait = Backoff(deadline=clock["now"] + 50e-6, spins=0)
    assert wait() and wait()                      # 20 + 40 us: the second starts at 20 us
    assert not wait()                             # starts at 60 us, past the deadline
    assert clock["naps"] == pytest.approx([20e-6, 40e-6])


def test_while_hurried_it_does_not_sleep_and_then_resumes_doubling(clock):
    hurried = [True]
    wait = Backoff(spins=1, hurry=lambda: hurried[0])
    assert all(wait() for _ in range(5))
    assert clock["naps"] == []
    hurried[0] = False
    assert wait() and wait()
    assert clock["naps"] == pytest.approx([20e-6, 40e-6])


def test_hurried_it_still_answers_false_past_the_deadline(clock):
    wait = Backoff(deadline=clock["now"] + 1.0, spins=0, hurry=lambda: True)
    assert wait()
    clock["now"] += 2.0
    assert not wait()
    assert clock["naps"] == []
