"""auto's on-line trials (collectives.autotune): the model's shortlist is tried in the first
calls of a size, every rank settles on the same pick, and results stay right throughout."""
import time

import numpy as np
import pytest

from mpidist.collectives import allreduce, allreduce_async, autotune, costmodel, registry
from mpidist.collectives.costmodel import CostModel, coefficients


def _model(p: int, predicted: dict) -> CostModel:
    """A model predicting these seconds per algorithm at any size (alpha terms only)."""
    fits = {a: [t / max(coefficients(a, p)[0], 1), 0.0] for a, t in predicted.items()}
    return CostModel({"world": {"p": p, "gamma": 0.0, "fits": fits, "samples": {}}}, 1, 1)


def _data(comm, n):
    """Small integers: every algorithm's float32 sum is exact, so every call is checkable."""
    return (np.arange(n) % 7 + comm.rank).astype(np.float32)


def _expected(comm, n):
    return comm.size * (np.arange(n) % 7) + comm.size * (comm.size - 1) / 2


@pytest.mark.parametrize("n", [1000, 65536])
def test_trials_settle_on_the_same_pick_on_every_rank(comm, n):
    tuner = autotune.tuner(comm)
    trials = tuner.calls_to_settle(4 * n)
    for _ in range(trials + 3):
        x = _data(comm, n)
        assert np.array_equal(allreduce(x, comm=comm), _expected(comm, n))
    assert tuner.calls_to_settle(4 * n) == 0
    if comm.size == 1:
        assert trials == 0
        return
    pick = tuner.decisions[4 * n]
    states = list(tuner.summary().values())
    assert len(states) == 1 and states[0]["pick"] == pick
    shortlist = states[0]["shortlist"]
    assert pick in shortlist and set(shortlist) <= set(costmodel.get_model(comm).candidates())
    assert trials == (0 if len(shortlist) == 1 else (1 + autotune.ROUNDS) * len(shortlist))
    assert len(set(comm.comm.allgather(pick))) == 1


@pytest.mark.mpi(min_size=2)
def test_trials_overrule_a_model_that_is_wrong(comm, monkeypatch):
    """The model puts "tree" far ahead, but tree is made 20 ms slower: the trials settle on
    another algorithm of the shortlist, on every rank."""
    tree = registry.ALGORITHMS["tree"]

    def slow_tree(*args):
        time.sleep(0.02)
        tree(*args)

    monkeypatch.setitem(registry.ALGORITHMS, "tree", slow_tree)
    model = _model(comm.size, {"tree": 10e-6, "ring": 13e-6, "native": 15e-6})
    costmodel.install(comm, model)
    assert model.choose(4096) == "tree"
    tuner = autotune.tuner(comm)
    for _ in range(tuner.calls_to_settle(4096) + 2):
        x = _data(comm, 1024)
        assert np.array_equal(allreduce(x, comm=comm), _expected(comm, 1024))
    pick = tuner.decisions[4096]
    assert pick in ("ring", "native")
    assert len(set(comm.comm.allgather(pick))) == 1


def test_async_calls_queued_behind_the_trials(comm):
    """More asynchronous calls than there are trials, all started before any wait: the
    calls queued behind the trials run the pick once it is agreed."""
    n = 4096
    xs = [_data(comm, n) for _ in range(autotune.tuner(comm).calls_to_settle(4 * n) + 5)]
    handles = [allreduce_async(x, comm=comm) for x in xs]
    for h, x in zip(handles, xs):
        assert h.wait(timeout=60) is x
        assert np.array_equal(x, _expected(comm, n))
    assert autotune.tuner(comm).calls_to_settle(4 * n) == 0


def test_autotune_off_follows_the_model_alone(comm, monkeypatch):
    monkeypatch.setenv("MPIDIST_AUTOTUNE", "0")
    model = _model(comm.size, {"tree": 10e-6, "ring": 13e-6})
    costmodel.install(comm, model)
    tuner = autotune.tuner(comm)
    assert tuner.calls_to_settle(4096) == 0
    x = _data(comm, 1024)
    assert np.array_equal(allreduce(x, comm=comm), _expected(comm, 1024))
    assert type(tuner.choose(4096)) is str
    assert tuner.choose(4096) == ("tree" if comm.size > 1 else "native")
    assert tuner.summary() == {}
