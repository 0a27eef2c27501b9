"""auto's on-line trials (collectives.autotune): the first call of a size times the model's
shortlist on its own data, every rank keeps the same pick, and every call runs that pick."""
import json
import time

import numpy as np
import pytest

from mpidist.collectives import allreduce, allreduce_async, autotune, costmodel, registry
from mpidist.collectives.costmodel import CostModel, coefficients
from mpidist.comm import Communicator


def _model(p: int, predicted: dict) -> CostModel:
    """A model predicting these seconds per algorithm at any size (alpha terms only)."""
    fits = {a: [t / max(coefficients(a, p)[0], 1), 0.0] for a, t in predicted.items()}
    return CostModel({"world": {"p": p, "gamma": 0.0, "fits": fits, "samples": {}}}, 1, 1)


def _counting(monkeypatch, slow: str | None = None) -> dict:
    """Count the runs of every algorithm (and make `slow` 20 ms slower), on every rank."""
    runs = {}
    for name, fn in list(registry.ALGORITHMS.items()):
        def wrapped(*args, name=name, fn=fn):
            runs[name] = runs.get(name, 0) + 1
            if name == slow:
                time.sleep(0.02)
            fn(*args)
        monkeypatch.setitem(registry.ALGORITHMS, name, wrapped)
    return runs


@pytest.mark.parametrize("n", [1000, 65536])
def test_the_first_call_tries_the_shortlist_and_every_rank_keeps_one_pick(comm, n,
                                                                          monkeypatch):
    cached = costmodel.get_model(comm)            # the machine's model, no remembered picks
    costmodel.install(comm, CostModel(cached.levels, cached.nodes, cached.per_node))
    x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    before = x.copy()
    out = np.empty_like(x)
    runs = _counting(monkeypatch)
    allreduce(x, comm=comm, out=out)
    assert np.array_equal(x, before)                          # the trials leave it alone
    tuner = autotune.tuner(comm)
    if comm.size == 1:
        assert tuner.decisions == {4 * n: "native"} and tuner.trials == {}
        assert runs == {"native": 1}
        return
    found = tuner.trials[autotune.size_class(4 * n)]
    shortlist, pick, rounds = found["shortlist"], found["pick"], found["rounds"]
    assert set(shortlist) <= set(costmodel.get_model(comm).candidates()) and pick in shortlist
    assert found["model_pick"] == costmodel.get_model(comm).choose(4 * n) == shortlist[0]
    trials = (1 + rounds) * len(shortlist) if len(shortlist) > 1 else 0
    assert runs == {a: (1 + rounds) + (a == pick) if trials else 1 for a in shortlist}
    assert len(set(comm.comm.allgather(pick))) == 1
    # later calls look the pick up; in place and out of place give the same bits
    results = [allreduce(x.copy(), comm=comm) for _ in range(3)]
    assert runs[pick] == (1 + rounds) * (trials > 0) + 4
    assert all(np.array_equal(r, out) for r in results)
    assert comm.auto_picks is tuner.decisions and comm.auto_picks[4 * n] == pick


def test_reset_forgets_the_picks_of_one_communicator_only(comm):
    other = Communicator(comm.comm)
    try:
        for c in (comm, other):
            allreduce(np.ones(10, np.float32), comm=c)
        assert comm.auto_picks.get(40) and other.auto_picks.get(40)
        autotune.reset(comm)
        assert comm.auto_picks == {} and other.auto_picks.get(40)
        assert Communicator.auto_picks == {}                  # the shared default stays empty
        x = np.ones(10, np.float32)
        allreduce(x, comm=comm)                               # a new tuner decides again
        assert comm.auto_picks.get(40) and np.all(x == comm.size)
    finally:
        other.free()


@pytest.mark.mpi(min_size=2)
def test_trials_overrule_a_model_that_is_wrong(comm, monkeypatch):
    """The model puts "tree" far ahead, but tree is made 20 ms slower: the trials keep
    another algorithm of the shortlist, on every rank."""
    _counting(monkeypatch, slow="tree")
    model = _model(comm.size, {"tree": 10e-6, "ring": 13e-6, "native": 15e-6})
    costmodel.install(comm, model)
    assert model.choose(4096) == "tree"
    x = (np.arange(1024) % 7 + comm.rank).astype(np.float32)
    allreduce(x, comm=comm)
    assert np.array_equal(x, comm.size * (np.arange(1024) % 7) + comm.size * (comm.size - 1) / 2)
    pick = autotune.tuner(comm).decisions[4096]
    assert pick in ("ring", "native")
    assert len(set(comm.comm.allgather(pick))) == 1


def test_asynchronous_calls_choose_the_same_way(comm, monkeypatch):
    """allreduce_async resolves auto (trials included) when it is called; the fused buckets
    of a list each get the pick of their own size."""
    runs = _counting(monkeypatch)
    xs = [np.full(4096, comm.rank + 1.0, np.float32) for _ in range(4)]
    handles = [allreduce_async(x, comm=comm) for x in xs]
    handles.append(allreduce_async([np.ones(10, np.float32), np.ones(300000, np.float32)],
                                   comm=comm, bucket_bytes=4096))
    total = comm.size * (comm.size + 1) / 2
    for h, x in zip(handles, xs):
        assert h.wait(timeout=60) is x and np.all(x == total)
    assert all(np.all(a == comm.size) for a in handles[-1].wait(timeout=60))
    tuner = autotune.tuner(comm)
    if comm.size > 1:
        assert {4 * 4096, 40, 4 * 300000} <= set(tuner.decisions)
        assert runs[tuner.decisions[4 * 4096]] >= 4
        assert len(set(map(repr, comm.comm.allgather(sorted(tuner.decisions.items()))))) == 1


def test_autotune_off_follows_the_model_alone(comm, monkeypatch):
    monkeypatch.setenv("MPIDIST_AUTOTUNE", "0")
    runs = _counting(monkeypatch)
    model = _model(comm.size, {"tree": 10e-6, "ring": 13e-6})
    costmodel.install(comm, model)
    x = np.ones(1024, np.float32)
    allreduce(x, comm=comm)
    assert np.all(x == comm.size)
    assert runs == {"tree" if comm.size > 1 else "native": 1}
    assert autotune.tuner(comm).trials == {}


@pytest.mark.mpi(min_size=2)
def test_a_pick_is_remembered_in_the_cache_file_for_later_processes(comm, shared_dir,
                                                                      monkeypatch):
    """The trial's pick goes into the cached model's file; a new communicator on the same
    layout (as a later process would) starts from it and runs no trial."""
    monkeypatch.setenv("MPIDIST_CACHE_DIR", shared_dir)
    path = costmodel.cache_path(comm)
    if comm.rank == 0:
        costmodel._write(path, _model(comm.size, {"tree": 10e-6, "ring": 13e-6,
                                                  "native": 15e-6}).to_json())
    comm.comm.Barrier()
    runs = _counting(monkeypatch, slow="tree")
    x = np.ones(1024, np.float32)
    allreduce(x, comm=comm)
    pick = autotune.tuner(comm).decisions[4096]
    assert pick in ("ring", "native")
    key = str(autotune.size_class(4096))
    if comm.rank == 0:
        with open(path) as fh:
            assert json.load(fh)["picks"] == {key: pick}
    later = Communicator()
    try:
        runs.clear()
        allreduce(x, comm=later)
        assert runs == {pick: 1} and np.all(x == comm.size ** 2)
        assert autotune.tuner(later).trials[int(key)]["remembered"]
    finally:
        later.free()


def test_remember_leaves_a_file_that_holds_another_model(tmp_path):
    path = str(tmp_path / "model.json")
    other = _model(2, {"ring": 1e-6, "tree": 2e-6}).to_json()
    costmodel._write(path, other)
    mine = _model(2, {"ring": 3e-6, "tree": 2e-6})
    mine.path = path
    mine.remember(48, "tree")
    assert mine.picks == {48: "tree"}
    with open(path) as fh:
        assert json.load(fh) == other
    costmodel._write(path, mine.to_json())
    mine.remember(52, "ring")
    with open(path) as fh:
        assert CostModel.from_json(json.load(fh)).picks == {48: "tree", 52: "ring"}


@pytest.mark.mpi(min_size=2)
def test_ranks_follow_the_first_ranks_autotune_setting(comm, monkeypatch):
    """MPIDIST_AUTOTUNE=0 on every rank but the first: all run the trials, none hangs."""
    if comm.rank:
        monkeypatch.setenv("MPIDIST_AUTOTUNE", "0")
    costmodel.install(comm, _model(comm.size, {"tree": 10e-6, "ring": 13e-6}))
    runs = _counting(monkeypatch)
    x = np.ones(1024, np.float32)
    allreduce(x, comm=comm)
    assert np.all(x == comm.size) and autotune.tuner(comm).enabled
    assert sum(runs.values()) == 1 + (1 + autotune.ROUNDS) * 2


@pytest.mark.mpi(min_size=2)
def test_no_memory_for_the_trial_on_one_rank_keeps_the_models_choice(comm, monkeypatch):
    """The last rank cannot allocate the trial's copy: every rank skips the trial (none is
    left waiting in it) and runs the model's choice."""
    from mpidist.collectives import core
    if comm.rank == comm.size - 1:
        def no_room(*args):
            raise MemoryError("no room for the trial's copy")
        monkeypatch.setattr(core, "trial_runner", no_room)
    costmodel.install(comm, _model(comm.size, {"tree": 10e-6, "ring": 13e-6}))
    runs = _counting(monkeypatch)
    x = np.ones(1024, np.float32)
    allreduce(x, comm=comm)
    assert np.all(x == comm.size) and runs == {"tree": 1}
    assert autotune.tuner(comm).trials[autotune.size_class(4096)]["rounds"] == 0


@pytest.mark.mpi(min_size=2)
def test_a_large_message_is_tried_on_its_first_trial_bytes(comm, monkeypatch):
    from mpidist.collectives import core
    sizes = []
    runner = core.trial_runner

    def recording(c, x, opx):
        sizes.append(x.size)
        return runner(c, x, opx)

    monkeypatch.setattr(core, "trial_runner", recording)
    monkeypatch.setattr(autotune, "TRIAL_BYTES", 4096)
    costmodel.install(comm, _model(comm.size, {"tree": 10e-6, "ring": 13e-6}))
    x = np.ones(100000, np.float32)
    allreduce(x, comm=comm)
    assert sizes == [1024] and np.all(x == comm.size)
