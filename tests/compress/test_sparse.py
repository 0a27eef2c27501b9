"""The sparsifiers' training techniques (mpidist.compress.sparse): momentum correction and
masking, the warm-up ramp, local clipping, their state in checkpoints, their config checks,
and training with every optimizer. Local tests check each rank alone; the allreduce and
training tests run on all ranks, with expected values written in terms of `size`."""
import numpy as np
import pytest

from mpidist.compress import CompressedAllreduce, make_compressor
from mpidist.compress.sparse import exponential_warmup
from mpidist.engine import DistributedOptimizer
from mpidist.engine.config import validate
from mpidist.errors import ConfigError
from mpidist.flat import Layout
from mpidist.optim import build_optimizer

LAYOUT = Layout([("fc1.weight", (40, 30)), ("fc1.bias", (30,)), ("fc2.weight", (30, 10)),
                 ("fc2.bias", (10,))])
SPARSE = ["topk", "randomk"]


def grad(step, rank=0, n=LAYOUT.numel):
    return np.random.default_rng(1000 * step + rank).standard_normal(n).astype(np.float32)


# ---------------------------------------------------------------- momentum correction
@pytest.mark.parametrize("name", SPARSE)
@pytest.mark.parametrize("masking", [True, False])
def test_sent_plus_residual_is_the_accumulated_velocity(name, masking):
    """sum of decompressed payloads + residual = sum of u_t, u_t = m u_(t-1) + g_t (masked
    where sent with momentum masking): nothing the momentum-corrected gradient holds is lost."""
    c = make_compressor(name, ratio=0.05, momentum=0.9, momentum_masking=masking, seed=3)
    u = np.zeros(LAYOUT.numel, np.float64)
    total_u = np.zeros_like(u)
    sent = np.zeros_like(u)
    for t in range(12):
        g = grad(t)
        u = 0.9 * u + g
        total_u += u
        payload, ctx = c.compress(g, LAYOUT)
        sent += c.decompress(payload, ctx)
        if masking:
            u[c.sent_indices(payload, ctx)] = 0
        np.testing.assert_allclose(c.velocity, u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sent + c.residual, total_u, rtol=1e-5, atol=1e-4)


def test_dense_momentum_correction_sends_the_momentum_sgd_velocity():
    """At ratio 1 without masking each call sends u_t exactly: momentum SGD's update."""
    c = make_compressor("topk", ratio=1.0, momentum=0.5, momentum_masking=False)
    u = np.zeros(LAYOUT.numel, np.float32)
    for t in range(4):
        g = grad(t)
        u = np.float32(0.5) * u + g
        np.testing.assert_array_equal(c.decompress(*c.compress(g, LAYOUT)), u)
        assert not c.residual.any()


def test_masking_forgets_the_velocity_of_what_was_sent():
    c = make_compressor("topk", ratio=0.1, momentum=0.9)
    payload, ctx = c.compress(grad(0), LAYOUT)
    idx = c.sent_indices(payload, ctx)
    assert idx.size == int(np.ceil(0.1 * LAYOUT.numel))
    assert not c.velocity[idx].any()
    assert np.count_nonzero(c.velocity) == LAYOUT.numel - idx.size


# ---------------------------------------------------------------- warm-up and clipping
@pytest.mark.parametrize("name", SPARSE)
def test_warmup_ramp_gives_the_configured_ratios_at_the_configured_steps(name):
    stages = [[0.25, 2], [0.0625, 3], [0.015625, 1]]
    c = make_compressor(name, ratio=0.01, warmup=stages)
    expected = [0.25] * 2 + [0.0625] * 3 + [0.015625] + [0.01] * 3
    for step, ratio in enumerate(expected):
        assert c.ratio_at(step) == ratio
        payload, _ = c.compress(grad(step), LAYOUT)
        assert payload[0].size == int(np.ceil(ratio * LAYOUT.numel)), step
    assert exponential_warmup(0.25, 0.01, 11) == [[0.25, 11], [0.0625, 11], [0.015625, 11]]
    assert exponential_warmup(0.01, 0.01, 11) == []


@pytest.mark.parametrize("name", SPARSE)
def test_local_clipping_bounds_what_enters_the_residual(name):
    g = grad(0)
    norm = float(np.linalg.norm(g))
    c = make_compressor(name, ratio=0.1, clip_norm=norm / 4)
    payload, ctx = c.compress(g, LAYOUT)
    np.testing.assert_allclose(c.decompress(payload, ctx) + c.residual, g / 4, rtol=1e-5, atol=1e-6)
    small = make_compressor(name, ratio=0.1, clip_norm=norm * 2)       # below the bound: as is
    payload, ctx = small.compress(g, LAYOUT)
    np.testing.assert_array_equal(small.decompress(payload, ctx) + small.residual, g)


# ---------------------------------------------------------------- state and options
@pytest.mark.parametrize("name", SPARSE)
def test_state_dict_carries_velocity_residual_and_ramp_position(name):
    opts = dict(ratio=0.02, warmup=[[0.2, 2]], momentum=0.8, clip_norm=30.0)
    a = make_compressor(name, **opts)
    for t in range(3):
        a.compress(grad(t), LAYOUT)
    sd = a.state_dict()
    assert sd["velocity"].shape == (LAYOUT.numel,) and sd["step"] == 3
    b = make_compressor(name, **opts)
    b.load_state_dict(sd)
    for t in range(3, 5):
        pa, ca = a.compress(grad(t), LAYOUT)
        pb, cb = b.compress(grad(t), LAYOUT)
        assert all(np.array_equal(x, y) for x, y in zip(pa, pb))
        np.testing.assert_array_equal(a.velocity, b.velocity)
    with pytest.raises(ValueError, match="same options"):
        make_compressor(name, **{**opts, "momentum": 0.5}).load_state_dict(sd)


@pytest.mark.parametrize("opts,message", [
    ({"warmup": [[11, 0.25]]}, r"warmup stage 0: ratio must be in \[0.01, 1\]"),
    ({"warmup": [[0.25, 0]]}, "warmup stage 0: steps must be an int >= 1"),
    ({"warmup": [0.25]}, r"warmup stage 0 must be a \[ratio, steps\] pair"),
    ({"momentum": 1.0}, r"momentum must be a number in \[0, 1\)"),
    ({"momentum": 0.9, "error_feedback": False}, "needs error_feedback=True"),
    ({"clip_norm": 0}, "clip_norm must be a finite number > 0"),
])
@pytest.mark.parametrize("name", SPARSE)
def test_bad_options_name_the_valid_range(name, opts, message):
    with pytest.raises(ValueError, match=message):
        make_compressor(name, ratio=0.01, **opts)


def test_ring_refuses_momentum_masking(comm):
    with pytest.raises(ValueError, match="needs the gather algorithm"):
        CompressedAllreduce(make_compressor("topk", momentum=0.9), comm, algorithm="ring")
    CompressedAllreduce(make_compressor("topk", momentum=0.9, momentum_masking=False), comm,
                        algorithm="ring")


def _config_errors(parallel, optim=None):
    with pytest.raises(ConfigError) as info:
        validate({"parallel": parallel, "optim": optim or {"name": "lamb"}})
    return str(info.value)


def test_config_checks_options_algorithm_and_double_momentum():
    ok = validate({"parallel": {"compression": "topk", "compression_allreduce": "gather",
                                "compression_options": {"ratio": 0.01, "momentum": 0.9,
                                                        "warmup": [[0.25, 11], [0.0625, 11]]}},
                   "optim": {"name": "sgd", "hyper": {"momentum": 0.0}}})
    assert ok["parallel"]["compression_options"]["warmup"] == [[0.25, 11], [0.0625, 11]]
    assert validate({})["parallel"]["compression_allreduce"] == "auto"
    text = _config_errors({"compression": "topk", "compression_options": {"warmup": [[11, 0.25]]}})
    assert "[parallel] compression_options: warmup stage 0: ratio must be in [0.01, 1]" in text
    text = _config_errors({"compression": "randomk", "compression_allreduce": "gather"})
    assert "compression_allreduce = 'gather': compressor 'randomk' aggregates by 'linear'" in text
    text = _config_errors({"compression": "topk", "compression_allreduce": "ring",
                           "compression_options": {"momentum": 0.9}})
    assert "needs the gather algorithm" in text
    text = _config_errors({"compression_allreduce": "ring"})
    assert "compression_allreduce needs compression" in text
    text = _config_errors({"compression_allreduce": "tree", "compression": "topk"})
    assert "compression_allreduce = 'tree': choose one of" in text
    text = _config_errors({"compression": "topk", "compression_options": {"momentum": 0.9}},
                          {"name": "lars"})
    assert "replaces the optimizer's momentum: set [optim] hyper.momentum = 0" in text


# ---------------------------------------------------------------- on all ranks
@pytest.mark.parametrize("name", SPARSE)
def test_allreduce_with_momentum_correction_loses_nothing(comm, name):
    """Over ranks and calls: size * (sum of averages) + sum of residuals = sum of every
    rank's momentum-corrected gradients (unmasked accumulation, u taken before masking)."""
    opts = dict(ratio=0.03, warmup=[[0.2, 2]], momentum=0.9, clip_norm=40.0)
    ca = CompressedAllreduce(make_compressor(name, **opts), comm)
    ref = make_compressor(name, **opts)       # this rank's u_t, reproduced
    ref.stream = comm.rank
    total_out = np.zeros(LAYOUT.numel, np.float64)
    total_u = np.zeros_like(total_out)
    for t in range(6):
        g = grad(t, comm.rank)
        total_out += ca(g, LAYOUT)
        before = ref.velocity if ref.velocity is not None else 0
        g = g * min(1.0, 40.0 / float(np.linalg.norm(g)))
        total_u += 0.9 * before + g
        ref.compress(grad(t, comm.rank), LAYOUT)
    residuals = comm.comm.allreduce(ca.compressor.residual.astype(np.float64))
    us = comm.comm.allreduce(total_u)
    np.testing.assert_allclose(comm.size * total_out + residuals, us, rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(ca.compressor.velocity, ref.velocity)


@pytest.mark.parametrize("optimizer,hyper", [
    ("sgd", {"lr": 0.05}), ("adamw", {"lr": 0.05}),
    ("lars", {"lr": 2.0, "eta": 0.05, "momentum": 0.0}), ("lamb", {"lr": 0.05})])
def test_training_converges_with_every_optimizer(comm, optimizer, hyper):
    """Least squares, top-k 5% with warm-up, momentum correction and clipping, each rank
    a different share of the gradient: the loss falls by 10x in 80 steps with each optimizer."""
    rng = np.random.default_rng(7)
    target = rng.standard_normal((20, 8)).astype(np.float32)
    w = rng.standard_normal((20, 8)).astype(np.float32)
    dopt = DistributedOptimizer.for_arrays(
        [w], lambda layout: build_optimizer(optimizer, layout, weight_decay=0.0, **hyper),
        names=["w.weight"], comm=comm, bucket_mb=0,
        compression=make_compressor("topk", ratio=0.05, warmup=[[0.5, 5], [0.2, 5]], momentum=0.5,
                                    clip_norm=10.0))
    share = 2.0 * (comm.rank + 1) / (comm.size + 1)       # the average over ranks is 1

    def loss():
        return float(((w - target) ** 2).mean())

    first = loss()
    for _ in range(80):
        dopt.step([(w - target) * share])
    assert np.isfinite(loss()) and loss() < first / 10, (first, loss())
