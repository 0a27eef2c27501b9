"""The alpha-beta-gamma cost model (experiments.costmodel): its formulas, its fits and its
probe. mpidist itself decides from measurement alone; the model is an experiment."""
import json
import math

import pytest

from experiments import costmodel
from experiments.costmodel import CostModel, coefficients


def test_coefficients_follow_the_algorithms():
    assert coefficients("ring", 4) == (6, 1.5, 0.75)
    assert coefficients("recursive_doubling", 4) == (2, 2, 2)
    assert coefficients("recursive_doubling", 5) == (4, 4, 3)          # folded: 2 extra steps
    assert coefficients("rabenseifner", 8) == (6, 1.75, 0.875)
    assert coefficients("ring", 1) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="no cost formula"):
        coefficients("bogus", 4)


def test_fit_recovers_alpha_and_beta():
    p, alpha, beta, gamma = 4, 20e-6, 0.5e-9, 0.1e-9
    sizes = [4 << 10, 64 << 10, 1 << 20, 8 << 20]
    a, b, g = coefficients("ring", p)
    times = [a * alpha + b * n * beta + g * n * gamma for n in sizes]
    fa, fb = costmodel.fit_least_squares("ring", p, gamma, sizes, times)
    assert math.isclose(fa, alpha, rel_tol=1e-6) and math.isclose(fb, beta, rel_tol=1e-6)


def test_pieces_run_through_the_probe_points():
    """Bytes dearer above 4 MiB (out of cache; continuous at the break): each range between
    neighbouring probe sizes gets its own (alpha, beta), predictions hit every probe
    point, and sizes past the last point follow the last piece."""
    p, gamma, brk = 4, 0.1e-9, 4 << 20
    a, b, g = coefficients("ring", p)
    near = (200e-6, 0.5e-9)
    far = (near[0] - b * brk * 0.1e-9 / a, 0.6e-9)
    sizes = list(costmodel.PROBE_SIZES)

    def cost(n):
        al, be = near if n <= brk else far
        return a * al + b * n * be + g * n * gamma

    times = [cost(n) for n in sizes]
    pieces = costmodel.fit_pieces("ring", p, gamma, sizes, times)
    assert [pc[0] for pc in pieces] == sizes[1:]
    for pc in pieces:
        al, be = near if pc[0] <= brk else far
        assert math.isclose(pc[1], al, rel_tol=1e-6) and math.isclose(pc[2], be, rel_tol=1e-6)
    m = CostModel({"world": {"p": p, "gamma": gamma, "fits": {"ring": [0.0, 0.0]},
                             "pieces": {"ring": pieces}}}, 1, 1)
    for n in sizes + [1 << 30]:
        assert math.isclose(m.predict("ring", n), cost(n))


def test_pieces_follow_a_time_that_grows_faster_than_the_bytes():
    """An MPI library that faults in a fresh buffer per call can take 12x longer at 64 MiB
    than at 16 MiB: the piece between them needs a negative alpha to pass through both
    points. The first and last pieces, which also extrapolate, never
    predict a negative time or one that falls with more bytes."""
    p, gamma = 2, 0.0
    sizes = [1 << 20, 16 << 20, 64 << 20, 256 << 20]
    times = [0.12e-3, 2.21e-3, 27.16e-3, 25e-3]              # noise: 256 MiB below 64 MiB
    pieces = costmodel.fit_pieces("native", p, gamma, sizes, times)
    m = CostModel({"world": {"p": p, "gamma": gamma, "fits": {"native": [0.0, 0.0]},
                             "pieces": {"native": pieces}}}, 1, 1)
    for n, t in zip(sizes, times):
        assert math.isclose(m.predict("native", n), t)
    assert 2.21e-3 < m.predict("native", 40 << 20) < 27.16e-3
    assert 0 <= m.predict("native", 8) <= m.predict("native", 1 << 20)
    assert math.isclose(m.predict("native", 1 << 30), 4 * 25e-3)    # past the last point


def _model(p=4, nodes=1, per_node=1):
    fits = {"ring": [50e-6, 0.4e-9], "tree": [30e-6, 0.5e-9], "dbtree": [60e-6, 0.6e-9],
            "shm": [100e-6, 0.9e-9],
            "recursive_doubling": [2e-6, 0.6e-9], "rabenseifner": [15e-6, 0.5e-9],
            "native": [40e-6, 2.0e-9]}
    levels = {"world": {"p": p, "gamma": 0.1e-9, "fits": fits, "samples": {}}}
    if nodes > 1:
        levels["intra"] = {"p": per_node, "gamma": 0.1e-9, "fits": {"ring": [5e-6, 0.1e-9]}}
        levels["inter"] = {"p": nodes, "gamma": 0.1e-9, "fits": {"ring": [500e-6, 5e-9]}}
    return CostModel(levels, nodes, per_node)


def test_choice_follows_predictions():
    m = _model()
    assert m.choose(64) == "recursive_doubling"       # latency-bound
    assert m.choose(256 << 20) == "ring"               # bandwidth-bound
    assert "hierarchical" not in m.candidates()
    for n in (64, 1 << 20, 256 << 20):
        assert m.predict(m.choose(n), n) == min(m.predict(a, n) for a in m.candidates())
    h = _model(p=8, nodes=2, per_node=4)
    assert "hierarchical" in h.candidates()
    n = 64 << 20
    expect = (coefficients("ring", 4)[0] * 5e-6 + n * (1.5 * 0.1e-9 + 0.75 * 0.1e-9)
              + coefficients("ring", 2)[0] * 500e-6 + n / 4 * (1 * 5e-9 + 0.5 * 0.1e-9))
    assert math.isclose(h.predict("hierarchical", n), expect)
    assert CostModel.from_json(json.loads(json.dumps(h.to_json()))).choose(n) == h.choose(n)


def test_probe_agrees_on_every_rank(comm):
    m = costmodel.probe(comm, sizes=(1 << 10, 16 << 10), reps=1)
    texts = comm.comm.allgather(json.dumps(m.to_json(), sort_keys=True))
    assert len(set(texts)) == 1
    if comm.size > 1:
        fits = m.levels["world"]["fits"]
        expect = set(costmodel.FLAT) - ({"shm"} if comm.num_nodes > 1 else set())
        assert set(fits) == expect and all(a >= 0 and b >= 0 for a, b in fits.values())
        assert m.choose(1 << 10) in m.candidates()
        cond = m.levels["world"]["conditions"]
        assert cond["sizes"] == [1 << 10, 16 << 10] and cond["seconds"] >= 0
        assert {"load_before", "load_after", "when"} <= set(cond)
        assert len(cond["state_s"]) == 3 and min(cond["state_s"]) > 0     # before, after each
        assert isinstance(cond["state_steady"], bool)


@pytest.mark.mpi(min_size=2)
def test_probe_repeats_a_level_that_saw_the_machine_state_move(comm, monkeypatch):
    """A probe whose machine_state samples moved by more than STATE_TOLERANCE mixes two
    machines: the level is probed again, and the steadier attempt is kept."""
    states = iter([1e-4, 3e-4, 3e-4,            # first attempt: the state tripled
                   2e-4, 2.1e-4, 2e-4])         # second: steady
    calls = []
    monkeypatch.setattr(costmodel, "machine_state", lambda c: calls.append(1) or next(states))
    m = costmodel.probe(comm, sizes=(1 << 10, 4 << 10), reps=1)
    cond = m.levels["world"]["conditions"]
    assert len(calls) == 6 and cond["state_s"] == [2e-4, 2.1e-4, 2e-4]
    assert cond["state_steady"] is True
