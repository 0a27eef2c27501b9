"""Each compressor on one rank: round-trip bounds, unbiasedness, error feedback, state,
bad input. Local work only, so these pass at any rank count (each rank checks itself)."""
import math

import ml_dtypes
import numpy as np
import pytest

from mpidist.compress import compressor_names, make_compressor
from mpidist.flat import Layout
from mpidist.kernels import compress_cpu as K

LAYOUT = Layout([("fc1.weight", (48, 40)), ("fc1.bias", (40,)), ("fc2.weight", (40, 10)),
                 ("fc2.bias", (10,))])

EF_CONFIGS = [("topk", {"ratio": 0.05}), ("topk", {"ratio": 0.05, "method": "sampled"}),
              ("randomk", {"ratio": 0.1}), ("sign", {"chunk": 64}),
              ("qsgd", {"levels": 3, "error_feedback": True}), ("powersgd", {"rank": 2}),
              ("fp16", {"error_feedback": True})]


def grad(n, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


# ---------------------------------------------------------------- casting
@pytest.mark.parametrize("scale", [1e-9, 1.0, 1e6])
def test_fp16_round_trip_bound_and_scaling(scale):
    x = grad(5000, 1, scale)
    x[:3] = [0.0, x[3] * 1e-7, -x[4] * 1e-12]         # zero, tiny entries
    c = make_compressor("fp16")
    y = c.decompress(*c.compress(x))
    amax = float(np.abs(x).max())
    assert np.isfinite(y).all()                        # 1e6 overflows plain fp16, not this
    assert np.all(np.abs(y - x) <= 2.0**-11 * np.abs(x) + 2.0**-39 * amax)


def test_fp16_kernel_bit_exact_against_numpy():
    x = np.concatenate([grad(20000, 2), [0.0, -0.0, 65504, 65520, 1e5, 6e-8, 3e-8, 1e-30,
                                          np.inf, -np.inf, 2.0**-24, 2.0**-25]]).astype(np.float32)
    out = np.empty(x.size, np.uint16)
    K.fp16_encode(x.view(np.uint32), 0, out)
    with np.errstate(over="ignore"):
        assert np.array_equal(out, x.astype(np.float16).view(np.uint16))
        K.fp16_encode(x.view(np.uint32), 3, out)
        assert np.array_equal(out, (x * np.float32(8)).astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("k", [0, 7, -3, 110])
def test_fp16_decode_kernel_exhaustive(k):
    """Every float16 bit pattern decodes to exactly float32(value * 2**-k)."""
    half = np.arange(2**16, dtype=np.uint16)
    out = np.zeros(half.size, np.float32)
    make_compressor("fp16").decode_add((half, np.array([k], np.int32)), {"n": half.size}, out)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        ref = (half.view(np.float16).astype(np.float64) * 2.0**-k).astype(np.float32)
    assert np.array_equal(out, ref, equal_nan=True)


def test_bf16_round_trip_bound_and_bit_exact():
    x = np.concatenate([grad(20000, 3), [0.0, 1e-40, 3e38]]).astype(np.float32)
    c = make_compressor("bf16")
    payload, ctx = c.compress(x)
    assert np.array_equal(payload[0], x.astype(ml_dtypes.bfloat16).view(np.uint16))
    y = c.decompress(payload, ctx)
    assert np.all(np.abs(y - x) <= 2.0**-8 * np.abs(x) + 2.0**-134)


# ---------------------------------------------------------------- sparsification
@pytest.mark.parametrize("n,ratio", [(1000, 0.01), (300_000, 0.01), (200_000, 0.2)])
def test_topk_exact_is_argpartition(n, ratio):
    x = grad(n, 4)
    c = make_compressor("topk", ratio=ratio, error_feedback=False)
    (vals, idx), ctx = c.compress(x)
    k = math.ceil(ratio * n)
    ref = np.sort(np.argpartition(np.abs(x), n - k)[n - k:])
    assert np.array_equal(idx.astype(np.int64), ref)
    assert np.array_equal(vals, x[ref])
    y = c.decompress((vals, idx), ctx)
    assert np.sum((x - y) ** 2) <= (1 - k / n) * np.sum(x.astype(np.float64) ** 2)


def test_topk_sampled_keeps_the_largest():
    n, ratio = 400_000, 0.01
    x = grad(n, 5)
    (vals, idx), _ = make_compressor("topk", ratio=ratio, method="sampled").compress(x)
    k = math.ceil(ratio * n)
    assert k // 2 <= idx.size <= 2 * k
    assert np.all(np.diff(idx.astype(np.int64)) > 0)
    rest = np.ones(n, bool)
    rest[idx] = False
    assert np.abs(vals).min() >= np.abs(x[rest]).max()


def test_randomk_strata_and_shared_indices():
    n, ratio = 10_007, 0.03
    a, b = make_compressor("randomk", ratio=ratio), make_compressor("randomk", ratio=ratio)
    b.stream = 5                                   # another rank: the same indices
    x = grad(n, 6)
    (vals, ), ctx = a.compress(x)
    (_, ), ctx_b = b.compress(grad(n, 7))
    idx, k = ctx["idx"], math.ceil(ratio * n)
    assert idx.size == k and np.array_equal(idx, ctx_b["idx"])
    bounds = (np.arange(k + 1) * n) // k                  # one index in each stratum
    assert np.array_equal(np.searchsorted(bounds, idx, side="right") - 1, np.arange(k))
    assert np.array_equal(vals, x[idx])
    (_, ), ctx2 = a.compress(x)
    assert not np.array_equal(ctx2["idx"], idx)       # a new draw each step


# ---------------------------------------------------------------- quantization
def test_sign_error_identity_per_chunk():
    chunk, x = 64, grad(64 * 20 + 24, 8)
    c = make_compressor("sign", chunk=chunk, error_feedback=False)
    payload, ctx = c.compress(x)
    assert payload[0].nbytes == -(-x.size // 8) and payload[1].size == -(-x.size // chunk)
    y = c.decompress(payload, ctx)
    for lo in range(0, x.size, chunk):
        xc, yc = x[lo:lo + chunk].astype(np.float64), y[lo:lo + chunk]
        assert np.all(np.sign(yc) == np.where(xc >= 0, 1, -1))
        expected = np.sum(xc**2) - np.sum(np.abs(xc)) ** 2 / xc.size
        assert np.sum((xc - yc) ** 2) == pytest.approx(expected, rel=1e-4, abs=1e-9)


@pytest.mark.parametrize("n,pieces", [(64 * 20 + 21, [(0, 600), (600, 0), (600, 701)]),
                                      (5, [(0, 5)]), (0, [(0, 0)])])
def test_sign_fused_feedback_equals_the_steps_apart(n, pieces):
    """The one-pass error feedback gives the bits, scales and residuals of with_residual,
    encode and residual_of run one after the other, step after step."""
    fused, apart = make_compressor("sign", chunk=64), make_compressor("sign", chunk=64)
    apart.fuses_feedback = False
    for step in range(3):
        x = grad(n, 20 + step)
        for (pf, _), (pa, _) in zip(fused.compress_pieces(x, pieces), apart.compress_pieces(x, pieces)):
            assert all(np.array_equal(a, b) for a, b in zip(pf, pa))
        assert np.array_equal(fused.residual.view(np.uint32), apart.residual.view(np.uint32))
        assert fused.step == apart.step == step + 1
    (pf, _), (pa, _) = fused.compress(x), apart.compress(x)
    assert all(np.array_equal(a, b) for a, b in zip(pf, pa))
    assert np.array_equal(fused.residual, apart.residual) and x.shape == (n,)


@pytest.mark.parametrize("levels", [1, 7, 100])
def test_qsgd_bound_and_packing(levels):
    bucket, x = 128, grad(128 * 10 + 40, 9)
    c = make_compressor("qsgd", levels=levels, bucket=bucket)
    (codes, norms), ctx = c.compress(x)
    width = {1: 2, 7: 4, 100: 8}[levels]
    assert codes.nbytes == -(-x.size * width // 8)
    y = c.decompress((codes, norms), ctx)
    step = np.repeat(norms, bucket)[:x.size] / levels
    assert np.all(np.abs(x - y) <= step * (1 + 1e-6))


def test_qsgd_unbiased():
    draws, levels, x = 600, 3, grad(2048, 10)
    c = make_compressor("qsgd", levels=levels, bucket=256)
    total = np.zeros(x.size)
    for _ in range(draws):
        total += c.decompress(*c.compress(x))
    mean = total / draws
    # per draw, each element is one of two levels norm/s apart: std <= norm / (2 s)
    norm = np.repeat(np.abs(x).reshape(-1, 256).max(axis=1), 256)
    sigma = norm / (2 * levels * math.sqrt(draws))
    assert np.all(np.abs(mean - x) <= 6 * sigma)
    assert abs(np.mean(mean - x)) <= 6 * sigma.max() / math.sqrt(x.size)


def test_powersgd_recovers_low_rank_layers():
    rng = np.random.default_rng(11)
    views = {}
    for s in LAYOUT:
        if len(s.shape) == 2:
            a, b = rng.standard_normal((s.shape[0], 2)), rng.standard_normal((2, s.shape[1]))
            views[s.name] = a @ b
        else:
            views[s.name] = rng.standard_normal(s.shape)
    x = np.concatenate([views[s.name].ravel() for s in LAYOUT]).astype(np.float32)
    c = make_compressor("powersgd", rank=2)
    payload, ctx = c.compress(x, LAYOUT)
    plan = ctx["plan"]
    assert len(plan.matrices) == 2 and len(plan.dense) == 2       # biases go dense
    assert c.payload_nbytes(payload) == 4 * (plan.p_size + plan.q_size) < x.nbytes
    y = c.decompress(payload, ctx)
    assert np.linalg.norm(y - x) <= 1e-5 * np.linalg.norm(x)
    assert np.abs(c.residual).max() <= 1e-5 * np.abs(x).max()


# ---------------------------------------------------------------- error feedback
@pytest.mark.parametrize("name,opts", EF_CONFIGS)
def test_error_feedback_accounts_for_everything(name, opts):
    """sum of applied updates + final residual == sum of true gradients."""
    c = make_compressor(name, **opts)
    true, applied = np.zeros(LAYOUT.numel), np.zeros(LAYOUT.numel)
    for t in range(6):
        g = grad(LAYOUT.numel, 20 + t)
        applied += c.decompress(*c.compress(g, LAYOUT))
        true += g
    assert np.allclose(applied + c.residual, true, rtol=0, atol=2e-5 * np.abs(true).max())
    assert np.linalg.norm(c.residual) < np.linalg.norm(true)


@pytest.mark.parametrize("name,opts", [("topk", {"ratio": 0.05}), ("powersgd", {"rank": 2}),
                                       ("qsgd", {"levels": 7})])
def test_state_dict_resumes_identically(name, opts):
    a = make_compressor(name, **opts)
    for t in range(3):
        a.compress(grad(LAYOUT.numel, t), LAYOUT)
    b = make_compressor(name, **opts)
    b.load_state_dict(a.state_dict())
    g = grad(LAYOUT.numel, 99)
    pa, pb = a.compress(g, LAYOUT)[0], b.compress(g, LAYOUT)[0]
    assert all(np.array_equal(u, v) for u, v in zip(pa, pb))
    with pytest.raises(ValueError, match="same options"):
        make_compressor(name, seed=3, **opts).load_state_dict(a.state_dict())


def test_nan_does_not_touch_the_residual():
    c = make_compressor("topk", ratio=0.1)
    c.compress(grad(1000, 1))
    before = c.residual.copy()
    g = grad(1000, 2)
    g[17] = np.nan
    with pytest.raises(ValueError, match="inf or NaN"):
        c.compress(g)
    assert np.array_equal(c.residual, before) and c.step == 1


# ---------------------------------------------------------------- bad input
def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError) as info:
        make_compressor("zip")
    for name in compressor_names():
        assert name in str(info.value)
    assert set(compressor_names()) == {"fp16", "bf16", "topk", "randomk", "sign", "qsgd",
                                       "powersgd"}


@pytest.mark.parametrize("name,opts,match", [
    ("topk", {"ratio": 0.0}, "ratio"), ("topk", {"ratio": 1.5}, "ratio"),
    ("randomk", {"ratio": -0.1}, "ratio"), ("topk", {"method": "fast"}, "method"),
    ("powersgd", {"rank": 0}, "rank"), ("qsgd", {"levels": 0}, "levels"),
    ("qsgd", {"levels": 128}, "levels"), ("sign", {"chunk": 12}, "multiple of 8"),
    ("fp16", {"ratio": 0.1}, "takes options")])
def test_out_of_range_options_rejected(name, opts, match):
    with pytest.raises(ValueError, match=match):
        make_compressor(name, **opts)


def test_powersgd_needs_a_layout():
    with pytest.raises(ValueError, match="layout"):
        make_compressor("powersgd").compress(grad(100))


def test_wrong_input_rejected():
    c = make_compressor("sign")
    with pytest.raises(TypeError, match="float32"):
        c.compress(np.zeros(16))
    with pytest.raises(ValueError, match="1-D"):
        c.compress(np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match="layout"):
        c.compress(np.zeros(16, np.float32), LAYOUT)


@pytest.mark.parametrize("cond", [1.0, 1e3, 1e5, "singular"])
def test_powersgd_orthonormal_basis_of_any_block(cond):
    """Step II's basis (CholeskyQR2 on the CPU) spans P's columns and is orthonormal, for
    ill-conditioned and rank-deficient blocks (a zero gradient) alike."""
    from mpidist.compress.powersgd import make_plan, orthonormalize
    r, rng = 4, np.random.default_rng(0)
    plan = make_plan([(0, (300, 40)), (12000, (300, 40)), (24000, (50, 60))], r)
    p = np.zeros(plan.p_size, np.float32)
    for _, rows, _, po, _ in plan.matrices:
        u = np.linalg.qr(rng.standard_normal((rows, r)))[0]
        s = np.array([1.0, 0.0, 0.0, 0.0]) if cond == "singular" else np.geomspace(1.0, 1.0 / cond, r)
        p[po:po + rows * r] = (u * s @ np.linalg.qr(rng.standard_normal((r, r)))[0]).ravel()
    before = p.copy()
    orthonormalize(p, plan, r, np)
    for _, rows, _, po, _ in plan.matrices:
        q, m = p[po:po + rows * r].reshape(rows, r), before[po:po + rows * r].reshape(rows, r)
        assert np.abs(q.T @ q - np.eye(r)).max() < 1e-5
        assert np.abs(m - q @ (q.T @ m)).max() < 1e-5 * np.abs(m).max()   # spans P
