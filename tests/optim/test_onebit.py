"""1-bit Adam and 1-bit LAMB: the fused kernels and the two-sided compressed momentum
average on real ranks equal the NumPy reference (which simulates every rank in one
process) to rtol 1e-6 over 100 steps, warm-up and compression stage, for each momentum
compressor; the state round-trips; bad settings fail with a message. Any rank count."""
import numpy as np
import pytest

from mpidist.compress import MomentumAllreduce, make_compressor
from mpidist.flat import Layout
from mpidist.optim import build_optimizer
from mpidist.optim.reference_onebit import OnebitReference

LAYOUT = Layout([("emb.weight", (21, 20)), ("fc1.weight", (24, 17)), ("fc1.bias", (17,)),
                 ("norm.weight", (17,)), ("fc2.weight", (17, 9)), ("fc2.bias", (9,))])
COMPRESSORS = [("sign", {"chunk": 32}), ("topk", {"ratio": 0.1}), ("randomk", {"ratio": 0.1}),
               ("qsgd", {"levels": 7, "error_feedback": True})]
CASES = [("onebit_adam", {}), ("onebit_adam", {"weight_decay": 0.1, "exclude": ("*bias",)}),
         ("onebit_lamb", {}), ("onebit_lamb", {"weight_decay": 0.1, "bias_correction": False}),
         ("onebit_lamb", {"factor_threshold": 0.3, "exclude": ()}),
         ("onebit_adam", {"precondition": False}), ("onebit_lamb", {"precondition": False})]
STEPS, FREEZE = 100, 10


def grads_of(step, size, n):
    """Every rank's gradient of this step (the same draws on every rank); the first 20
    elements never get one (an always-zero input: v = 0 there)."""
    rng = np.random.default_rng(1000 + step)
    out = [(rng.standard_normal(n) * 0.05 + 0.02).astype(np.float32) for _ in range(size)]
    for g in out:
        g[:20] = 0
    return out


def run(comm, name, hyper, cname, copts, steps=STEPS, opt=None, ex=None, start=0, p=None):
    """Step the optimizer as a data-parallel rank does: the summed gradient in warm-up, then
    local momentum -> compressed exchange -> step on the averaged momentum."""
    n, size = LAYOUT.numel, comm.size
    opt = opt or build_optimizer(name, LAYOUT, lr=0.01, freeze_step=FREEZE, compressor=cname,
                                 compressor_options=copts, **hyper)
    ex = ex or MomentumAllreduce(make_compressor(cname, **copts), n, comm)
    p = np.random.default_rng(7).standard_normal(n).astype(np.float32) if p is None else p
    coeffs = []
    for t in range(start, start + steps):
        grads = grads_of(t, size, n)
        if not opt.frozen:
            g = np.zeros(n, np.float32)
            for gi in grads:
                g += gi
            info = opt.step(p, g)
        else:
            if not ex.ready:
                ex.gather(opt.state_buffers()["exp_avg"], opt.offset)
            den = opt.frozen_denominator(opt.state_buffers()["exp_avg_sq"])
            mine = grads[comm.rank].copy()
            opt.local_momentum(ex.momentum, mine, den, size)
            m = ex.allgather(ex.reduce_scatter(mine), den)
            info = opt.step(p, m, finite=True)
        assert not info.skipped
        coeffs.append(info.trust_ratios)
    return opt, ex, p, coeffs


@pytest.mark.parametrize("cname,copts", COMPRESSORS, ids=[c for c, _ in COMPRESSORS])
@pytest.mark.parametrize("name,hyper", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_kernels_and_exchange_equal_reference(comm, name, hyper, cname, copts):
    opt, ex, p, coeffs = run(comm, name, hyper, cname, copts)
    twin = build_optimizer(name, LAYOUT, lr=0.01, freeze_step=FREEZE, compressor=cname,
                           compressor_options=copts, **hyper)
    ref = OnebitReference(twin, comm.size, lambda: make_compressor(cname, **copts))
    q = np.random.default_rng(7).standard_normal(LAYOUT.numel).astype(np.float32)
    want = [ref.step(q, grads_of(t, comm.size, LAYOUT.numel)) for t in range(STEPS)]
    np.testing.assert_allclose(p, q, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ex.momentum, ref.m, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(opt.state_buffers()["exp_avg"], ref.m, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(opt.state_buffers()["exp_avg_sq"], ref.v, rtol=1e-6, atol=0)
    if name == "onebit_lamb":
        np.testing.assert_allclose(opt.state_buffers()["exp_avg_sq_fresh"], ref.vf, rtol=1e-6)
        for got, expect in zip(coeffs, want):
            np.testing.assert_allclose(got, expect, rtol=1e-6)
    # the server residual is this rank's chunk of the reference's
    lo, cnt = ex.offset, ex.count
    np.testing.assert_allclose(ex.server.residual, ref.servers[comm.rank].residual,
                               rtol=1e-6, atol=1e-7)
    assert ex.server.residual.shape == (cnt,) and lo + cnt <= LAYOUT.numel
    np.testing.assert_allclose(ex.worker.compressor.residual, ref.workers[comm.rank].residual,
                               rtol=1e-6, atol=1e-7)


def test_variance_is_frozen_and_momentum_compressed(comm):
    opt, ex, p, _ = run(comm, "onebit_adam", {}, "sign", {}, steps=FREEZE)
    v = opt.state_buffers()["exp_avg_sq"].copy()
    run(comm, "onebit_adam", {}, "sign", {}, steps=5, opt=opt, ex=ex, start=FREEZE, p=p)
    np.testing.assert_array_equal(opt.state_buffers()["exp_avg_sq"], v)
    # sign: 1/8 byte per element plus one float32 scale per 256 (per chunk piece)
    if comm.size > 1:
        dense = 2 * (comm.size - 1) / comm.size * 4 * LAYOUT.numel
        assert 0 < ex.bytes_sent < dense / 8


def test_state_round_trip_continues_exactly(comm):
    """Stop after 30 steps, copy optimizer and exchange state into fresh objects, go on:
    the same bits as 60 uninterrupted steps (the resume does not restart the warm-up)."""
    opt, ex, p, _ = run(comm, "onebit_lamb", {}, "sign", {}, steps=60)
    o1, e1, p1, _ = run(comm, "onebit_lamb", {}, "sign", {}, steps=30)
    o2 = build_optimizer("onebit_lamb", LAYOUT, lr=0.01, freeze_step=FREEZE, compressor="sign")
    o2.load_state_dict(o1.state_dict())
    e2 = MomentumAllreduce(make_compressor("sign"), LAYOUT.numel, comm)
    e2.load_state_dict(e1.state_dict())
    assert o2.frozen and not e2.ready
    run(comm, "onebit_lamb", {}, "sign", {}, steps=30, opt=o2, ex=e2, start=30, p=p1)
    np.testing.assert_array_equal(p1, p)


def test_compression_stage_misuse_fails_with_a_message(comm):
    opt, ex, p, _ = run(comm, "onebit_lamb", {}, "sign", {}, steps=FREEZE)
    g = np.zeros(LAYOUT.numel, np.float32)
    with pytest.raises(RuntimeError, match="averaged momentum"):
        opt.partial_sums(p, g)
    warm = build_optimizer("onebit_adam", LAYOUT, freeze_step=5)
    with pytest.raises(RuntimeError, match="compression stage"):
        warm.local_momentum(g, g.copy(), np.ones_like(g))


@pytest.mark.parametrize("hyper,message", [
    ({"freeze_step": 0}, "freeze_step"), ({"compressor": 3}, "compressor"),
    ({"compressor_options": {"error_feedback": False}}, "error feedback"),
    ({"amsgrad": True}, "amsgrad")])
def test_bad_settings_say_what_to_do(hyper, message):
    with pytest.raises((TypeError, ValueError), match=message):
        build_optimizer("onebit_adam", LAYOUT, **hyper)


def test_exchange_refuses_powersgd_and_no_error_feedback(comm):
    with pytest.raises(ValueError, match="decode"):
        MomentumAllreduce(make_compressor("powersgd"), 10, comm)
    with pytest.raises(ValueError, match="error feedback"):
        MomentumAllreduce(make_compressor("qsgd"), 10, comm)
