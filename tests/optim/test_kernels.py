"""The Numba kernels equal the NumPy reference (rtol 1e-6) over 100 steps of random
gradients, for every optimizer and option, exclusions and fp16/bf16 master weights included."""
import ml_dtypes
import numpy as np
import pytest

from mpidist.flat import Layout
from mpidist.optim import build_optimizer
from mpidist.optim.plan import CHUNK
from mpidist.optim.reference import Reference

# odd sizes exercise the unrolled loops' tails
LAYOUT = Layout([("emb.weight", (21, 20)), ("fc1.weight", (24, 17)), ("fc1.bias", (17,)),
                 ("norm.weight", (17,)), ("fc2.weight", (17, 9)), ("fc2.bias", (9,))])
# a tensor larger than one CPU work item (base.CHUNK elements)
BIG = Layout([("big.weight", (CHUNK + 1001,)), ("big.bias", (3,))])

CASES = [
    ("sgd", {}),
    ("sgd", {"momentum": 0.9}),
    ("sgd", {"momentum": 0.9, "dampening": 0.3, "weight_decay": 1e-2}),
    ("sgd", {"momentum": 0.8, "nesterov": True, "weight_decay": 1e-2, "exclude": ("*bias",)}),
    ("adamw", {}),
    ("adamw", {"amsgrad": True, "weight_decay": 0.1, "exclude": ("*bias", "norm*")}),
    ("adamw", {"bias_correction": False, "betas": (0.8, 0.99), "eps": 1e-6}),
    ("lars", {"lr": 0.5}),
    ("lars", {"lr": 0.5, "momentum": 0.0, "eta": 0.02, "exclude": ()}),
    ("lars", {"lr": 0.5, "weight_decay": 1e-2, "exclude": ("fc2.*",)}),
    ("lamb", {}),
    ("lamb", {"amsgrad": True, "bias_correction": False, "exclude": ()}),
    ("lamb", {"phi_clamp": (0.5, 3.0), "trust_clamp": (0.1, 2.0), "weight_decay": 0.1}),
]


def run_pair(name, hyper, steps, dtype=np.float32, grad_dtype=None, loss_scale=1.0, seed=0,
             layout=LAYOUT):
    """Step an optimizer and its reference on the same random gradients; return both."""
    rng = np.random.default_rng(seed)
    opt = build_optimizer(name, layout, **hyper)
    ref = Reference(opt)
    p = rng.standard_normal(layout.numel).astype(dtype)
    q = p.copy()
    trusts = []
    for _ in range(steps):
        g = (rng.standard_normal(layout.numel) * loss_scale).astype(grad_dtype or dtype)
        info = opt.step(p, g, loss_scale=loss_scale)
        skipped, trust = ref.step(q, g, loss_scale=loss_scale)
        assert not info.skipped and not skipped
        trusts.append((info.trust_ratios, trust))
    return opt, ref, p, q, trusts


def assert_same(opt, ref, p, q, trusts):
    np.testing.assert_allclose(p.astype(np.float32), q.astype(np.float32), rtol=1e-6, atol=0)
    for k, v in ref.state.items():
        np.testing.assert_allclose(opt.state_buffers()[k], v, rtol=1e-6, atol=0, err_msg=k)
    if ref.master is not None:
        np.testing.assert_allclose(opt.state_buffers()["master"], ref.master, rtol=1e-6, atol=0)
    for got, want in trusts:
        if want is None:
            assert got is None
        else:
            np.testing.assert_allclose(got, want, rtol=1e-9)


@pytest.mark.parametrize("name,hyper", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_kernel_equals_reference(name, hyper):
    assert_same(*run_pair(name, hyper, steps=100))


@pytest.mark.parametrize("name", ["sgd", "adamw", "lars", "lamb"])
def test_tensor_spanning_several_chunks(name):
    hyper = {"momentum": 0.9} if name == "sgd" else {}
    assert_same(*run_pair(name, hyper, steps=10, layout=BIG))


@pytest.mark.parametrize("name", ["sgd", "adamw", "lars", "lamb"])
@pytest.mark.parametrize("dtype,grad_dtype", [(np.float16, None), (ml_dtypes.bfloat16, None),
                                              (ml_dtypes.bfloat16, np.float32)],
                         ids=["fp16", "bf16", "bf16-fp32grads"])
def test_half_precision_master_weights(name, dtype, grad_dtype):
    hyper = {"momentum": 0.9} if name == "sgd" else {}
    opt, ref, p, q, trusts = run_pair(name, hyper, steps=100, dtype=dtype, grad_dtype=grad_dtype,
                                      loss_scale=1024.0)
    assert p.dtype == np.dtype(dtype) and "master" in opt.state_buffers()
    assert_same(opt, ref, p, q, trusts)
    # the half-precision params are the rounded master weights
    np.testing.assert_array_equal(p, opt.state_buffers()["master"].astype(dtype))


def test_exclusions_leave_biases_undecayed_and_unadapted():
    """A zero gradient under LARS: decayed tensors move, excluded ones do not."""
    opt = build_optimizer("lars", LAYOUT, lr=1.0, weight_decay=0.1, momentum=0.0)
    assert [n for n, e in zip(LAYOUT.names, opt.excluded) if e] == ["fc1.bias", "norm.weight",
                                                                    "fc2.bias"]
    p = np.ones(LAYOUT.numel, np.float32)
    g = np.zeros_like(p)
    g[LAYOUT["fc1.weight"].offset] = 1.0    # ||g|| > 0 there, so it gets a real trust ratio
    info = opt.step(p, g)
    views = LAYOUT.views(p)
    for name in ("fc1.bias", "norm.weight", "fc2.bias"):
        assert np.all(views[name] == 1.0), name
        assert info.trust_ratios[LAYOUT[name].index] == 1.0
    # ||g|| = 0: trust 1, so only the decay moves it: w - lr*wd*w
    np.testing.assert_allclose(views["emb.weight"], 0.9, rtol=1e-7)
    assert np.all(views["fc1.weight"] < 1.0) and np.all(views["fc1.weight"] > 0.9)
