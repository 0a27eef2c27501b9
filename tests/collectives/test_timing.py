"""The timing harness the tuner and `bench allreduce` share (collectives.tuning.timing),
and the sizes their command lines take."""
import numpy as np

from mpidist.collectives.tuning import timing
from mpidist.sizes import format_size, parse_size


def test_round_order_is_shuffled_and_agreed():
    """Every round runs every call once; the orders are reproducible from the seed (so
    every rank runs the same one) and no call always follows the same other call."""
    m, rounds = 6, 40
    orders = [timing.round_order(m, i, seed=3) for i in range(rounds)]
    assert all(sorted(o) == list(range(m)) for o in orders)
    assert orders == [timing.round_order(m, i, seed=3) for i in range(rounds)]
    assert orders != [timing.round_order(m, i, seed=4) for i in range(rounds)]
    for k in range(m):
        before = {o[o.index(k) - 1] for o in orders if o.index(k) > 0}
        assert len(before) > 1, f"call {k} always timed after call {before}"


def test_time_rounds_times_every_call(comm):
    counts = {"a": 0, "b": 0}

    def bump(name):
        counts[name] += 1

    times = timing.time_rounds(comm, {n: (lambda n=n: bump(n)) for n in counts}, 5, seed=1)
    assert counts == {"a": 5, "b": 5}
    assert set(times) == {"a", "b"} and all(t.shape == (5,) and (t >= 0).all()
                                            for t in times.values())
    texts = comm.comm.allgather(times["a"].tobytes())
    assert len(set(texts)) == 1                      # the slowest rank's time, everywhere


def test_time_algorithms_runs_the_rounds_asked_or_the_budget(comm):
    """reps rounds when given; else as many as the time budget allows, within the bounds,
    the same count on every rank."""
    times = timing.time_algorithms(comm, ["native", "ring"], 1024, reps=2)
    assert set(times) == {"native", "ring"} and times["ring"].shape == (2,)
    few = timing.time_algorithms(comm, ["native"], 64, seconds=1e-9, min_reps=3)
    many = timing.time_algorithms(comm, ["native"], 64, seconds=10.0, max_reps=7)
    assert few["native"].shape == (3,) and many["native"].shape == (7,)
    assert len(set(comm.comm.allgather(many["native"].tobytes()))) == 1


def test_time_calls_warms_up_and_checks_each_call_once_then_times_the_rounds(comm):
    """Each call runs once untimed, with setup() before and warmed(name) after, then in as
    many timed rounds as asked; setup() runs before every call."""
    log = []
    calls = {n: (lambda n=n: log.append(n)) for n in ("a", "b")}
    times = timing.time_calls(comm, calls, reps=3, setup=lambda: log.append("setup"),
                              warmed=lambda n: log.append(f"warmed {n}"))
    assert log[:6] == ["setup", "a", "warmed a", "setup", "b", "warmed b"]
    assert log[6:].count("a") == log[6:].count("b") == 3 and log[6:].count("setup") == 6
    assert "warmed a" not in log[6:] and times["a"].shape == (3,)


def test_parse_size():
    assert [parse_size(s) for s in ("512", "4K", "64KiB", "1M", "2G", "1.5K", 7)] == \
        [512, 4096, 65536, 1 << 20, 2 << 30, 1536, 7]
    assert [format_size(n) for n in (512, 4096, 1 << 20, 1536)] == ["512", "4K", "1M", "1536"]
