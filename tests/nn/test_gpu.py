"""The layers on CuPy arrays give what they give on NumPy (skipped without a GPU)."""
import numpy as np
import pytest

from mpidist import nn


@pytest.mark.gpu
@pytest.mark.parametrize("name,kw,shape", [
    ("mlp", dict(in_features=12, out_features=5, hidden=[16], activation="gelu"), (4, 12)),
    ("cnn", dict(in_shape=(1, 8, 8), out_features=5, channels=[4, 6]), (3, 64)),
    ("gpt", dict(vocab=20, block=8, dim=16, heads=2, layers=1), (2, 8)),
])
def test_models_match_numpy_on_cupy(name, kw, shape):
    import cupy as cp
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, shape) if name == "gpt" else rng.normal(size=shape).astype(np.float32)
    t = rng.integers(0, 5 if name != "gpt" else 20, shape if name == "gpt" else shape[0])
    grads = []
    for xp in (np, cp):
        model = nn.build_model(name, **kw)
        _, _, g = nn.materialize(model, xp=xp, seed=1)
        ce = nn.SoftmaxCrossEntropy()
        loss, _ = ce.forward(model.forward(xp.asarray(x)), xp.asarray(t))
        model.backward(ce.backward(1.0))
        grads.append((loss, cp.asnumpy(g.data) if xp is cp else g.data))
    assert np.isclose(grads[0][0], grads[1][0], rtol=1e-4)
    assert np.allclose(grads[0][1], grads[1][1], rtol=1e-3, atol=1e-5)
