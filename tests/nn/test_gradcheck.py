"""Finite-difference checks of every layer's hand-written backward (float64, small shapes).

f(x, params) = sum(forward(x) * R) for a fixed random R; backward(R) must give df/dx and
ACCUMULATE df/dparams into the grad views. No MPI: each rank checks the same thing.
"""
import numpy as np
import pytest

from mpidist import nn

EPS = 1e-6


def _numeric(f, arr, idx):
    old = arr[idx]
    arr[idx] = old + EPS
    fp = f()
    arr[idx] = old - EPS
    fm = f()
    arr[idx] = old
    return (fp - fm) / (2 * EPS)


def _sample(shape, rng, k=12):
    size = int(np.prod(shape))
    return [np.unravel_index(i, shape) for i in rng.choice(size, min(k, size), replace=False)]


def check_layer(layer, x, *, check_input=True, seed=0, replay=None, tol=1e-6):
    """Compare backward with central differences on sampled input and parameter entries."""
    rng = np.random.default_rng(seed)
    layout, params, grads = nn.materialize(layer, dtype=np.float64, seed=seed) if layer.param_shapes() \
        else (None, None, None)
    if params is not None:       # move off the init values (e.g. LayerNorm's exact ones/zeros)
        params.data[...] += rng.normal(0, 0.1, params.data.shape)

    def f():
        if replay:
            replay()
        return float((layer.forward(x, train=True) * R).sum())

    if replay:
        replay()
    y = layer.forward(x, train=True)
    R = rng.normal(size=y.shape)
    dx = layer.backward(R.copy())
    if check_input:
        for idx in _sample(x.shape, rng):
            num = _numeric(f, x, idx)
            assert abs(num - dx[idx]) <= tol * max(1.0, abs(num)), f"input {idx}: {num} vs {dx[idx]}"
    if params is not None:
        analytic = grads.data.copy()
        for i in rng.choice(layout.numel, min(24, layout.numel), replace=False):
            num = _numeric(f, params.data, i)
            assert abs(num - analytic[i]) <= tol * max(1.0, abs(num)), \
                f"param element {i}: {num} vs {analytic[i]}"
    return layer


def test_linear_any_leading_shape():
    rng = np.random.default_rng(1)
    check_layer(nn.Linear(5, 3), rng.normal(size=(4, 5)))
    check_layer(nn.Linear(4, 6, bias=False), rng.normal(size=(2, 3, 4)))


@pytest.mark.parametrize("layer", [nn.ReLU(), nn.GELU(), nn.Flatten()], ids=["relu", "gelu", "flatten"])
def test_parameter_free_layers(layer):
    x = np.random.default_rng(2).normal(size=(3, 2, 4))
    x[np.abs(x) < 1e-3] = 0.5    # keep ReLU's kink away from the difference stencil
    check_layer(layer, x)


def test_layernorm():
    check_layer(nn.LayerNorm(6), np.random.default_rng(3).normal(size=(2, 3, 6)))


def test_dropout_train_and_eval():
    layer = nn.Dropout(0.4, seed=7)
    x = np.random.default_rng(4).normal(size=(5, 8))
    check_layer(layer, x, replay=lambda: setattr(layer, "_rng", np.random.default_rng(11)))
    assert np.array_equal(layer.forward(x, train=False), x)
    y = layer.forward(x, train=True)
    zeros = np.count_nonzero(y == 0)
    assert 0 < zeros < x.size
    assert np.allclose(y[y != 0], x[y != 0] / 0.6)


@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 0), (1, 0)])
def test_conv2d(stride, padding):
    check_layer(nn.Conv2d(2, 3, 3, stride=stride, padding=padding),
                np.random.default_rng(5).normal(size=(2, 2, 6, 5)))


def test_conv2d_matches_direct_convolution():
    rng = np.random.default_rng(6)
    layer = nn.Conv2d(2, 3, 3, padding=1)
    nn.materialize(layer, dtype=np.float64)
    x = rng.normal(size=(1, 2, 4, 4))
    y = layer.forward(x)
    w, b = layer.p["weight"], layer.p["bias"]
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    for o in range(3):
        for i in range(4):
            for j in range(4):
                ref = (xp[0, :, i:i + 3, j:j + 3] * w[o]).sum() + b[o]
                assert np.isclose(y[0, o, i, j], ref)


@pytest.mark.parametrize("cls", [nn.MaxPool2d, nn.AvgPool2d])
def test_pooling(cls):
    x = np.random.default_rng(7).permutation(2 * 3 * 6 * 4).reshape(2, 3, 6, 4).astype(np.float64)
    check_layer(cls(2), x)           # distinct values: the max is unique, differentiable
    check_layer(cls(3, stride=1), x)


def test_embedding_accumulates_repeated_ids():
    layer = nn.Embedding(7, 3)
    ids = np.array([[1, 4, 1], [6, 1, 0]])
    check_layer(layer, ids, check_input=False)
    _, _, grads = nn.materialize(layer, dtype=np.float64)
    layer.forward(ids)
    layer.backward(np.ones((2, 3, 3)))
    assert np.array_equal(grads.view("weight")[:, 0], [1, 3, 0, 0, 1, 0, 1])
    with pytest.raises(ValueError, match="ids must lie"):
        layer.forward(np.array([7]))


def test_causal_attention_gradient_and_causality():
    rng = np.random.default_rng(8)
    layer = nn.CausalSelfAttention(8, 2)
    x = rng.normal(size=(2, 5, 8))
    check_layer(layer, x)
    y = layer.forward(x, train=False)
    x2 = x.copy()
    x2[:, 3:] += 1.0                 # a change in the future leaves the past alone
    y2 = layer.forward(x2, train=False)
    assert np.allclose(y[:, :3], y2[:, :3]) and not np.allclose(y[:, 3:], y2[:, 3:])


def test_softmax_cross_entropy():
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(6, 5))
    t = rng.integers(0, 5, 6)
    ce = nn.SoftmaxCrossEntropy()
    loss, correct = ce.forward(logits, t)
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    assert np.isclose(loss, -np.log(p[np.arange(6), t]).sum())
    assert correct == int((logits.argmax(1) == t).sum())
    d = ce.backward(0.5)
    for idx in _sample(logits.shape, rng):
        num = _numeric(lambda: ce.forward(logits, t)[0] * 0.5, logits, idx)
        assert np.isclose(num, d[idx], atol=1e-7)


@pytest.mark.parametrize("name,kw,x", [
    ("mlp", dict(in_features=6, out_features=4, hidden=[5, 3], activation="gelu"), (3, 6)),
    ("cnn", dict(in_shape=(1, 4, 4), out_features=3, channels=[2, 3]), (2, 16)),
])
def test_models(name, kw, x):
    check_layer(nn.build_model(name, **kw), np.random.default_rng(10).normal(size=x))


def test_gpt_parameters():
    model = nn.build_model("gpt", vocab=11, block=6, dim=8, heads=2, layers=1)
    ids = np.random.default_rng(12).integers(0, 11, (2, 6))
    check_layer(model, ids, check_input=False)


def test_backward_accumulates_and_reports_grads_in_reverse_order():
    model = nn.MLP(4, 2, hidden=[3])
    layout, params, grads = nn.materialize(model, dtype=np.float64)
    reported = []
    model.set_grad_hook(reported.extend)
    x = np.random.default_rng(13).normal(size=(5, 4))
    model.forward(x)
    model.backward(np.ones((5, 2)))
    once = grads.data.copy()
    model.forward(x)
    model.backward(np.ones((5, 2)))
    assert np.allclose(grads.data, 2 * once)
    assert reported[:4] == ["fc2.weight", "fc2.bias", "fc1.weight", "fc1.bias"]
    assert sorted(reported) == sorted(layout.names * 2)


def test_bind_and_registry_errors():
    model = nn.MLP(4, 2, hidden=[3])
    with pytest.raises(ValueError, match="no view"):
        model.bind({}, {})
    with pytest.raises(ValueError, match="choose one of"):
        nn.build_model("resnet")
    with pytest.raises(ValueError, match="model 'mlp'"):
        nn.build_model("mlp", in_features=3, out_features=2, depth=4)
    with pytest.raises(ValueError, match="divisible"):
        nn.CausalSelfAttention(6, 4)


@pytest.mark.parametrize("name,kw,shape", [
    ("mlp", dict(in_features=6, out_features=4, hidden=[5]), (3, 6)),
    ("cnn", dict(in_shape=(2, 4, 4), out_features=3, channels=[2]), (2, 32)),
])
def test_no_input_grad_gives_the_same_parameter_gradients(name, kw, shape):
    x = np.random.default_rng(14).normal(size=shape)
    grads = []
    for skip in (False, True):
        model = nn.build_model(name, **kw)
        _, _, g = nn.materialize(model, dtype=np.float64, seed=2)
        if skip:
            model.no_input_grad()
        dx = model.backward(np.ones_like(model.forward(x)))
        assert (dx is None) == skip
        grads.append(g.data.copy())
    assert np.array_equal(grads[0], grads[1])
