"""The optimizer boundary: registry, validation, non-finite gradients, loss scaling,
state_dict round trips, schedules."""
import math

import ml_dtypes
import numpy as np
import pytest

from mpidist.flat import Layout
from mpidist.optim import (OPTIMIZERS, DynamicLossScaler, LRSchedule, build_lr_schedule,
                           build_optimizer, scale_lr)

LAYOUT = Layout([("fc.weight", (8, 5)), ("fc.bias", (5,)), ("ln.weight", (5,))])
HYPER = {"sgd": {"momentum": 0.9}, "adamw": {"amsgrad": True}, "lars": {}, "lamb": {},
         "onebit_adam": {}, "onebit_lamb": {}}


def arrays(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(LAYOUT.numel).astype(dtype),
            rng.standard_normal(LAYOUT.numel).astype(dtype))


def test_registry_lists_names_on_unknown():
    assert set(OPTIMIZERS) == {"sgd", "adamw", "lars", "lamb", "onebit_adam", "onebit_lamb"}
    with pytest.raises(ValueError, match="sgd, adamw, lars, lamb, onebit_adam, onebit_lamb"):
        build_optimizer("adam", LAYOUT)


@pytest.mark.parametrize("name,bad,match", [
    ("sgd", {"lr": -0.1}, "lr must be"),
    ("adamw", {"lr": float("nan")}, "lr must be"),
    ("adamw", {"betas": (1.0, 0.999)}, "beta1"),
    ("lamb", {"betas": (0.9, -0.1)}, "beta2"),
    ("adamw", {"eps": 0.0}, "eps"),
    ("lamb", {"eps": 1e-45}, "too small for float32"),
    ("sgd", {"nesterov": True}, "nesterov"),
    ("sgd", {"momentum": 0.9, "dampening": 0.1, "nesterov": True}, "nesterov"),
    ("lars", {"eta": 0.0}, "eta"),
    ("lars", {"weight_decay": -1e-4}, "weight_decay"),
    ("lamb", {"trust_clamp": (2.0, 1.0)}, "trust_clamp"),
    ("sgd", {"offset": 10, "count": 1000}, "exceeds"),
    ("adamw", {"backend": "opencl"}, "backend"),
])
def test_invalid_hyperparameters_rejected(name, bad, match):
    with pytest.raises(ValueError, match=match):
        build_optimizer(name, LAYOUT, **bad)


def test_wrong_types_rejected():
    with pytest.raises(TypeError, match="Layout"):
        build_optimizer("sgd", [("w", (2,))])
    with pytest.raises(TypeError, match="exclude"):
        build_optimizer("lars", LAYOUT, exclude="*bias")
    with pytest.raises(TypeError, match="betas"):
        build_optimizer("adamw", LAYOUT, betas=0.9)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_argument_mismatches(name):
    opt = build_optimizer(name, LAYOUT, **HYPER[name])
    p, g = arrays()
    with pytest.raises(ValueError, match=f"{LAYOUT.numel} elements"):
        opt.step(p[:-1], g[:-1])
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        opt.step(p.astype(np.float64), g.astype(np.float64))
    with pytest.raises(TypeError, match="grads must be float32 or"):
        opt.step(p, g.astype(np.float16))
    with pytest.raises(ValueError, match="contiguous"):
        opt.step(np.repeat(p, 2)[::2], g)
    with pytest.raises(TypeError, match="NumPy or CuPy"):
        opt.step(list(p), g)
    with pytest.raises(ValueError, match="loss_scale"):
        opt.step(p, g, loss_scale=0.0)
    opt.step(p, g)
    with pytest.raises(TypeError, match="holds state for float32"):
        opt.step(p.astype(np.float16), g.astype(np.float16))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_gradients_skip_the_step(name, bad):
    opt = build_optimizer(name, LAYOUT, **HYPER[name])
    p, g = arrays()
    opt.step(p, g)
    before_p = p.copy()
    before = {k: v.copy() for k, v in opt.state_buffers().items()}
    g[7] = bad
    info = opt.step(p, g)
    assert info.skipped and "non-finite" in info.reason and info.step == 1
    assert opt.step_count == 1
    np.testing.assert_array_equal(p, before_p)
    for k, v in opt.state_buffers().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    # the caller's agreed flag overrides the local check both ways
    assert opt.step(p, arrays(1)[1], finite=False).skipped
    np.testing.assert_array_equal(p, before_p)
    assert not opt.step(p, arrays(1)[1], finite=True).skipped and opt.step_count == 2


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_loss_scale_overflow_skips_and_backs_off(name):
    """fp16 params, scaled fp16 grads: an overflow skips the step and halves the scale;
    clean steps grow it back after growth_interval."""
    opt = build_optimizer(name, LAYOUT, **HYPER[name])
    scaler = DynamicLossScaler(init_scale=2.0 ** 15, growth_interval=2)
    p, g = arrays(dtype=np.float16)
    p0 = p.copy()
    with np.errstate(over="ignore"):
        big = (g.astype(np.float32) * 2.0 ** 15).astype(np.float16)  # |g| > 2 overflows fp16
    assert not np.isfinite(big).all()
    info = scaler.step(opt, p, big)
    assert info.skipped and scaler.scale == 2.0 ** 14 and scaler.overflows == 1
    np.testing.assert_array_equal(p, p0)
    assert opt.step_count == 0
    small = (g.astype(np.float32) * 2.0 ** 4).astype(np.float16)
    scaler.scale = 2.0 ** 4
    for _ in range(2):
        assert not scaler.step(opt, p, small).skipped
    assert scaler.scale == 2.0 ** 5 and opt.step_count == 2
    assert not np.array_equal(p, p0)


def test_loss_scale_unscales_gradients():
    """Same step from (g, scale 1) and (g*1024, scale 1024)."""
    p1, g = arrays()
    p2 = p1.copy()
    a, b = build_optimizer("adamw", LAYOUT), build_optimizer("adamw", LAYOUT)
    a.step(p1, g)
    b.step(p2, g * 1024.0, loss_scale=1024.0)
    np.testing.assert_array_equal(p1, p2)


def test_scaler_validation():
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="growth_interval"):
        DynamicLossScaler(growth_interval=0)
    s = DynamicLossScaler(init_scale=4.0, min_scale=2.0)
    s.update(False)
    s.update(False)
    assert s.scale == 2.0
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_state_dict_round_trip(name, dtype):
    """Save after 3 steps, load into a fresh optimizer, continue both: identical."""
    p, _ = arrays(dtype=dtype)
    a = build_optimizer(name, LAYOUT, **HYPER[name])
    for s in range(3):
        a.step(p, arrays(s + 1, dtype)[1])
    sd = a.state_dict()
    assert sd["step"] == 3 and sd["name"] == name and set(sd["state"]) == set(a.state_buffers())
    assert all(v.shape == (LAYOUT.numel,) and v.dtype == np.float32 for v in sd["state"].values())
    b = build_optimizer(name, LAYOUT, **HYPER[name])
    b.load_state_dict(sd)
    q = p.copy()
    for s in range(3, 5):
        g = arrays(s + 1, dtype)[1]
        a.step(p, g)
        b.step(q, g)
    np.testing.assert_array_equal(p, q)
    assert b.step_count == 5


def test_load_state_dict_rejects_mismatches():
    a = build_optimizer("adamw", LAYOUT)
    sd = a.state_dict()
    b = build_optimizer("adamw", LAYOUT, amsgrad=True)
    with pytest.raises(ValueError, match="state names"):
        b.load_state_dict(sd)
    c = build_optimizer("adamw", LAYOUT, offset=5)
    with pytest.raises(ValueError, match="shape"):
        c.load_state_dict(sd)
    with pytest.raises(ValueError, match="'adamw' optimizer given to 'lamb'"):
        build_optimizer("lamb", LAYOUT).load_state_dict(sd)
    sd["state"]["exp_avg"] = sd["state"]["exp_avg"].astype(np.float64)
    with pytest.raises(TypeError, match="float32"):
        build_optimizer("adamw", LAYOUT).load_state_dict(sd)


def test_reduce_norms_must_keep_the_shape():
    opt = build_optimizer("lamb", LAYOUT)
    p, g = arrays()
    with pytest.raises(ValueError, match="reduce_norms returned shape"):
        opt.step(p, g, reduce_norms=lambda x: x.sum(axis=0))


def test_schedule_lr_drives_the_step():
    sched = build_lr_schedule("cosine", 0.4, total_steps=10, warmup_steps=4)
    opt = build_optimizer("sgd", LAYOUT, lr=sched)
    p, g = arrays()
    lrs = [opt.step(p, g).lr for _ in range(10)]
    assert lrs == [sched(t) for t in range(10)]
    assert lrs[:4] == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_schedules_and_scaling_rules():
    cos = LRSchedule("cosine", 1.0, total_steps=110, warmup_steps=10, end_lr=0.1)
    assert cos(9) == 1.0 and cos(10) == 1.0 and cos(110) == pytest.approx(0.1)
    assert cos(60) == pytest.approx(0.55)
    poly = build_lr_schedule("poly", 2.0, 100, power=2.0)
    assert poly(0) == 2.0 and poly(50) == pytest.approx(0.5) and poly(100) == 0.0
    assert build_lr_schedule("constant", 0.3, 5, warmup_steps=2)(1) == 0.3
    assert scale_lr(0.1, 256, 8192) == pytest.approx(3.2)
    assert scale_lr(0.1, 256, 8192, rule="sqrt") == pytest.approx(0.1 * math.sqrt(32))
    with pytest.raises(ValueError, match="linear, sqrt"):
        scale_lr(0.1, 256, 512, rule="cube")
    with pytest.raises(ValueError, match="constant, cosine, poly"):
        build_lr_schedule("step", 0.1, 10)
    with pytest.raises(ValueError, match="warmup_steps"):
        LRSchedule("cosine", 0.1, total_steps=5, warmup_steps=6)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_empty_range_steps_and_still_reduces(name):
    """A shard with no elements (more ranks than elements) steps, and a layer-wise optimizer
    still calls reduce_norms, so the other ranks' collective is matched."""
    calls = []
    opt = build_optimizer(name, LAYOUT, offset=LAYOUT.numel, count=0, **HYPER[name])
    e = np.zeros(0, np.float32)
    info = opt.step(e, e.copy(), reduce_norms=lambda x: calls.append(x.shape) or x)
    assert not info.skipped and opt.step_count == 1
    assert calls == ([(len(LAYOUT), 2 if name == "lars" else 3)] if opt.layerwise else [])
