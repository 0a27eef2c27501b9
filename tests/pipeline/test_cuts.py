"""Stage cuts (pipeline.cuts) and the model as pipeline layers, without MPI."""
import itertools

import numpy as np
import pytest

from mpidist.nn import CNN, GPT, MLP, materialize
from mpidist.pipeline.cuts import (balanced_bounds, by_cost, by_cuts, by_params,
                                        measure_layer_costs, stage_bounds)
from mpidist.pipeline.stage import Stage, local_stages, materialize_stages, pipeline_layers


def _brute_force(w, k):
    n = len(w)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = [0, *cuts, n]
        worst = max(sum(w[b[i]:b[i + 1]]) for i in range(k))
        best = worst if best is None else min(best, worst)
    return best


def test_balanced_bounds_minimise_the_largest_stage():
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(1, 9))
        k = int(rng.integers(1, n + 1))
        w = [float(v) for v in rng.integers(0, 20, n)]
        b = balanced_bounds(w, k)
        assert b[0] == 0 and b[-1] == n and len(b) == k + 1
        assert all(x < y for x, y in zip(b, b[1:]))          # every stage has a layer
        worst = max(sum(w[b[i]:b[i + 1]]) for i in range(k))
        assert worst == pytest.approx(_brute_force(w, k))


def test_balanced_bounds_known_cuts():
    assert balanced_bounds([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced_bounds([4, 1, 1, 1, 1], 2) == [0, 1, 5]
    assert balanced_bounds([0, 0, 0, 0], 4) == [0, 1, 2, 3, 4]


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(ValueError, match="only 3 layers"):
        balanced_bounds([1, 2, 3], 4)
    with pytest.raises(ValueError, match="only 3 layers"):
        by_cuts([1, 2, 3], 3, 4)


def test_cuts_are_checked():
    assert by_cuts([2, 5], 7, 3) == [0, 2, 5, 7]
    with pytest.raises(ValueError, match="need 2 cut points"):
        by_cuts([2], 7, 3)
    with pytest.raises(ValueError, match="increase strictly"):
        by_cuts([5, 2], 7, 3)
    with pytest.raises(ValueError, match="increase strictly"):
        by_cuts([0, 2], 7, 3)
    with pytest.raises(ValueError, match="choose one of"):
        stage_bounds("random", [None] * 4, 2)


def test_by_params_balances_parameter_counts():
    model = MLP(16, 4, hidden=(64, 8, 8))       # fc1 is most of the model
    layers = [layer for _, layer in pipeline_layers(model)]
    b = by_params(layers, 2)
    assert b == [0, 1, len(layers)]


@pytest.mark.parametrize("model", [MLP(6, 3, hidden=(5, 4)), CNN((1, 8, 8), 3, channels=(2, 3)),
                                   GPT(vocab=7, block=4, dim=8, heads=2, layers=2)],
                         ids=["mlp", "cnn", "gpt"])
def test_pipeline_layers_keep_the_model_names_and_order(model):
    pieces = pipeline_layers(model)
    names = [s for prefix, layer in pieces for s in layer.param_shapes(prefix)]
    assert names == model.param_shapes()


def test_stages_compose_to_the_whole_model():
    model = GPT(vocab=7, block=4, dim=8, heads=2, layers=2)
    ref = GPT(vocab=7, block=4, dim=8, heads=2, layers=2)
    materialize(ref, dtype=np.float64, seed=5)
    layers = pipeline_layers(model)
    bounds = by_params([l for _, l in layers], 3)
    stages = {}
    for r in range(3):
        stages.update(local_stages(layers, bounds, 3, r))
    materialize_stages(model, stages, dtype=np.float64, seed=5)
    ids = np.random.default_rng(1).integers(0, 7, (3, 4))
    h = ids
    for s in range(3):
        h = stages[s].forward(h)
    np.testing.assert_allclose(h, ref.forward(ids), rtol=1e-12)


def test_measured_costs_drive_the_cut():
    model = MLP(32, 4, hidden=(256, 4))
    materialize(model, dtype=np.float64)
    layers = [layer for _, layer in pipeline_layers(model)]
    costs = measure_layer_costs(layers, np.ones((64, 32)), steps=2)
    assert len(costs) == len(layers) and all(c > 0 for c in costs)
    assert by_cost(costs, 2) == balanced_bounds(costs, 2)
    assert by_cost([1.0, 1.0, 5.0, 1.0], 2) == [0, 2, 4]


def test_stash_and_unstash_keep_micro_batches_apart():
    model = MLP(4, 3, hidden=(5,))
    materialize(model, dtype=np.float64, seed=2)
    stage = Stage(0, pipeline_layers(model))
    x1, x2 = np.ones((2, 4)), np.arange(8.0).reshape(2, 4)
    stage.forward(x1)
    saved = stage.stash()
    stage.forward(x2)
    stage.unstash(saved)
    dx = stage.backward(np.ones((2, 3)))
    model2 = MLP(4, 3, hidden=(5,))
    materialize(model2, dtype=np.float64, seed=2)
    model2.forward(x1)
    np.testing.assert_allclose(dx, model2.backward(np.ones((2, 3))))
