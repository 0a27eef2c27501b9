"""The compressed allreduce on real ranks: equal to the decompress-then-sum reference on
every rank, identical on all ranks, exact byte counts, warm-up, inf/NaN and mismatches.
Expected values are written in terms of `size`, so the file passes at any rank count."""
import numpy as np
import pytest

from mpidist.compress import CompressedAllreduce, make_compressor
from mpidist.compress.ring import ring_allreduce_bytes
from mpidist.compress.wire import pack, unpack
from mpidist.errors import MismatchError, RemoteError
from mpidist.flat import Layout

LAYOUT = Layout([("conv.weight", (16, 3, 3, 3)), ("conv.bias", (16,)),
                 ("fc.weight", (37, 29)), ("fc.bias", (29,))])

CONFIGS = [("topk", {"ratio": 0.03}), ("topk", {"ratio": 0.03, "method": "sampled"}),
           ("sign", {"chunk": 32}), ("qsgd", {"levels": 7, "bucket": 64}),
           ("randomk", {"ratio": 0.05}), ("powersgd", {"rank": 2}),
           ("fp16", {"error_feedback": True})]
RING_CONFIGS = [("sign", {"chunk": 32}),
                ("qsgd", {"levels": 3, "bucket": 64, "error_feedback": True}),
                ("topk", {"ratio": 0.05}), ("fp16", {"error_feedback": True}),
                ("bf16", {"error_feedback": True})]


def rank_grad(r, step, n=LAYOUT.numel):
    return np.random.default_rng(1000 * step + r).standard_normal(n).astype(np.float32)


def all_same(comm, arr) -> bool:
    ref = comm.comm.bcast(arr if comm.rank == 0 else None, root=0)
    return comm.all(np.array_equal(arr, ref, equal_nan=True))


class PowerSGDReference:
    """PowerSGD over p simulated ranks, written out from the paper in float64."""

    def __init__(self, rank, p, seed=0):
        self.r, self.p = rank, p
        plan = make_compressor("powersgd", rank=rank).plan_for(LAYOUT, LAYOUT.numel)
        q0 = np.random.default_rng(seed).standard_normal(plan.q_size).astype(np.float32)
        self.mats = [(off, rows, cols) for off, rows, cols, _, _ in plan.matrices]
        self.q = [q0[qo:qo + cols * rank].reshape(cols, rank).astype(np.float64)
                  for _, _, cols, _, qo in plan.matrices]
        self.err = [np.zeros(LAYOUT.numel) for _ in range(p)]
        self.plan = plan

    def step(self, grads):
        xs = [g + e for g, e in zip(grads, self.err)]
        out = sum(xs) / self.p                      # dense segments: the plain average
        for e in self.err:
            e[:] = 0
        for j, (off, rows, cols) in enumerate(self.mats):
            ms = [x[off:off + rows * cols].reshape(rows, cols) for x in xs]
            p_hat = np.linalg.qr(sum(m @ self.q[j] for m in ms))[0]
            qs = [m.T @ p_hat for m in ms]
            self.q[j] = sum(qs)
            out[off:off + rows * cols] = (p_hat @ self.q[j].T).ravel() / self.p
            for e, m in zip(self.err, ms):       # each rank keeps its share of the loss
                e[off:off + rows * cols] = (m - p_hat @ self.q[j].T / self.p).ravel()
        return out


@pytest.mark.parametrize("name,opts", CONFIGS)
def test_equals_decompress_then_sum_reference(comm, name, opts):
    p = comm.size
    ca = CompressedAllreduce(make_compressor(name, **opts), comm, algorithm=(
        "gather" if name == "fp16" else "auto"))
    refs = [make_compressor(name, **opts) for _ in range(p)]
    for r, c in enumerate(refs):
        c.stream = r
    psgd = PowerSGDReference(opts.get("rank", 1), p)
    for step in range(3):                      # residuals and warm starts carry over
        out = ca(rank_grad(comm.rank, step), LAYOUT)
        grads = [rank_grad(r, step) for r in range(p)]
        if name == "powersgd":
            ref = psgd.step([g.astype(np.float64) for g in grads])
            assert np.allclose(out, ref, rtol=0, atol=2e-4 * np.abs(ref).max())
            assert ca.bytes_sent == ring_allreduce_bytes(psgd.plan.p_size, p, comm.rank) + \
                ring_allreduce_bytes(psgd.plan.q_size, p, comm.rank)
        else:
            ref = np.zeros(LAYOUT.numel, np.float32)
            sent = []
            for c, g in zip(refs, grads):
                payload, ctx = c.compress(g, LAYOUT)
                c.decode_add(payload, ctx, ref)
                sent.append(pack(payload).nbytes)
            ref /= p
            if name == "randomk":
                # shared indices: values summed by the float32 ring, in another order
                assert np.allclose(out, ref, rtol=1e-6, atol=1e-6)
                k = refs[0].k_of(LAYOUT.numel)
                assert ca.bytes_sent == ring_allreduce_bytes(k, p, comm.rank)
            else:
                assert np.array_equal(out, ref)        # same payloads, same order: bitwise
                # ring allgather: every payload but the right neighbour's
                expected = 0 if p == 1 else sum(sent) - sent[(comm.rank + 1) % p]
                assert ca.bytes_sent == expected
        assert out.dtype == np.float32 and out.shape == (LAYOUT.numel,)
        assert all_same(comm, out)
    assert ca.step == 3 and ca.total_bytes_sent >= ca.bytes_sent


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_ring_on_half_precision_chunks(comm, name):
    """Each hop re-rounds a partial sum: within (p + 1) roundings of the exact mean."""
    p, n = comm.size, 10_001
    ca = CompressedAllreduce(make_compressor(name), comm)
    assert ca.algorithm == "ring"
    out = ca(rank_grad(comm.rank, 0, n).astype(np.float64))
    grads = np.stack([rank_grad(r, 0, n).astype(np.float64) for r in range(p)])
    exact = grads.mean(axis=0)
    unit = 2.0**-11 if name == "fp16" else 2.0**-8
    tol = (p + 1) * unit * np.abs(grads).sum(axis=0) / p + 2.0**-30
    assert out.dtype == np.float64
    assert np.all(np.abs(out - exact) <= tol)
    assert all_same(comm, out)
    # 2(p-1)/p of the 2-byte encoding, plus per message a 16-byte header and padding
    messages = 2 * (p - 1)
    half = ring_allreduce_bytes(n, p, comm.rank, itemsize=2)
    assert half <= ca.bytes_sent <= half + messages * (16 + 8 + 8)


def test_powersgd_float16_factors(comm):
    """factors="float16": P and Q cross as scaled float16, so a step sends half the bytes
    (plus a header per message); every rank ends with the same numbers, close to the
    float32 factors' result; and with error feedback nothing is lost: the ranks' residuals
    plus p times the results sum to every gradient."""
    p = comm.size
    half = CompressedAllreduce(make_compressor("powersgd", rank=2, factors="float16"), comm)
    full = CompressedAllreduce(make_compressor("powersgd", rank=2), comm)
    applied = np.zeros(LAYOUT.numel)
    for step in range(3):
        g = rank_grad(comm.rank, step)
        out, ref = half(g, LAYOUT), full(g, LAYOUT)
        assert all_same(comm, out)
        applied += out
        if step == 0:                           # the same warm start: one rounding apart
            assert np.allclose(out, ref, rtol=0, atol=2e-2 * np.abs(ref).max())
        plan = half.compressor.plan
        messages = 2 * (p - 1) * 2              # P's and Q's rings
        least = ring_allreduce_bytes(plan.p_size, p, comm.rank, itemsize=2) + \
            ring_allreduce_bytes(plan.q_size, p, comm.rank, itemsize=2)
        assert least <= half.bytes_sent <= least + messages * (16 + 8 + 8)
        assert half.bytes_sent <= full.bytes_sent / 2 + messages * 32
    true = sum(rank_grad(r, t).astype(np.float64) for r in range(p) for t in range(3))
    residuals = comm.comm.allreduce(half.compressor.residual.astype(np.float64))
    assert np.allclose(residuals + p * applied, true, rtol=0, atol=1e-5 * np.abs(true).max())
    with pytest.raises(ValueError, match="factors must be one of"):
        make_compressor("powersgd", factors="bfloat16")
    # a checkpoint keeps the choice: one written with float16 factors loads only into those
    sd = half.compressor.state_dict()
    make_compressor("powersgd", rank=2, factors="float16").load_state_dict(sd)
    with pytest.raises(ValueError, match="same options"):
        make_compressor("powersgd", rank=2).load_state_dict(sd)
    # warm-up: the whole gradient, rounded to float16 once per hop, no residual
    warm = CompressedAllreduce(make_compressor("powersgd", rank=2, factors="float16"), comm,
                               warmup_steps=1)
    g = rank_grad(comm.rank, 0)
    out = warm(g, LAYOUT)
    grads = np.stack([rank_grad(r, 0).astype(np.float64) for r in range(p)])
    tol = (p + 1) * 2.0**-11 * np.abs(grads).sum(axis=0) / p + 2.0**-30
    assert np.all(np.abs(out - grads.mean(axis=0)) <= tol) and all_same(comm, out)
    least = ring_allreduce_bytes(LAYOUT.numel, p, comm.rank, itemsize=2)
    assert least <= warm.bytes_sent <= least + 2 * (p - 1) * (16 + 8 + 8)
    assert warm.compressor.residual is None


@pytest.mark.parametrize("name,opts", RING_CONFIGS)
def test_ring_with_error_feedback_loses_nothing(comm, name, opts):
    """Re-encoded partial sums: sum over ranks of the residuals plus p times the running
    sum of results equals the running sum of all ranks' gradients."""
    p, n = comm.size, 4001
    ca = CompressedAllreduce(make_compressor(name, **opts), comm, algorithm="ring")
    applied = np.zeros(n)
    for step in range(3):
        out = ca(rank_grad(comm.rank, step, n))
        assert all_same(comm, out)
        applied += out
    true = sum(rank_grad(r, t, n).astype(np.float64) for r in range(p) for t in range(3))
    residuals = comm.comm.allreduce(ca.compressor.residual.astype(np.float64))
    assert np.allclose(residuals + p * applied, true, rtol=0, atol=1e-4 * np.abs(true).max())
    # one payload's 2(p-1)/p: each message a chunk's payload, its header and padding
    one = make_compressor(name, **opts)
    msg = max(pack(one.encode(np.ones(-(-n // p), np.float32), None)[0]).nbytes, 0)
    assert ca.bytes_sent <= 2 * (p - 1) * msg


@pytest.mark.parametrize("algorithm", ["gather", "ring"])
@pytest.mark.parametrize("n", [1, 3])
def test_gradients_shorter_than_the_ring(comm, algorithm, n):
    """Empty ring chunks (n < p) travel as empty messages; the sums stay right."""
    p = comm.size
    for name, opts in [("fp16", {}), ("sign", {"chunk": 8}), ("topk", {"ratio": 0.5})]:
        ca = CompressedAllreduce(make_compressor(name, **opts), comm, algorithm=algorithm)
        out = ca(rank_grad(comm.rank, 0, n))
        assert out.shape == (n,) and all_same(comm, out)
        if name == "fp16":
            grads = np.stack([rank_grad(r, 0, n).astype(np.float64) for r in range(p)])
            tol = (p + 1) * 2.0**-11 * np.abs(grads).sum(axis=0) / p
            assert np.all(np.abs(out - grads.mean(axis=0)) <= tol)


def test_warmup_runs_the_dense_ring(comm):
    p, n = comm.size, 5003
    ca = CompressedAllreduce(make_compressor("topk", ratio=0.01), comm, warmup_steps=1)
    out = ca(rank_grad(comm.rank, 0, n))
    exact = np.mean([rank_grad(r, 0, n).astype(np.float64) for r in range(p)], axis=0)
    assert np.allclose(out, exact, rtol=1e-6, atol=1e-6)
    assert ca.bytes_sent == ring_allreduce_bytes(n, p, comm.rank)
    assert ca.compressor.residual is None                      # no compression yet
    ca(rank_grad(comm.rank, 1, n))
    assert ca.compressor.residual is not None and ca.compressor.step == 1
    assert ca.bytes_sent < ring_allreduce_bytes(n, p, comm.rank) or p == 1


def test_nonfinite_raise_leaves_residuals_alone(comm):
    ca = CompressedAllreduce(make_compressor("sign"), comm)
    ca(rank_grad(comm.rank, 0))
    before = ca.compressor.residual.copy()
    g = rank_grad(comm.rank, 1)
    if comm.rank == comm.size - 1:
        g[5] = np.nan
    with pytest.raises(FloatingPointError, match=f"rank\\(s\\) \\[{comm.size - 1}\\]"):
        ca(g)
    assert np.array_equal(ca.compressor.residual, before)
    out = ca(rank_grad(comm.rank, 2))                          # and it goes on
    assert np.isfinite(out).all()


def test_nonfinite_skip_reports_and_goes_on(comm):
    ca = CompressedAllreduce(make_compressor("topk", ratio=0.05), comm, nonfinite="skip")
    ca(rank_grad(comm.rank, 0))
    before = ca.compressor.residual.copy()
    g = rank_grad(comm.rank, 1)
    if comm.rank == 0:
        g[-1] = np.inf
    out = ca(g)
    assert ca.last_skipped and ca.skipped_steps == 1 and np.isnan(out).all()
    assert np.array_equal(ca.compressor.residual, before) and ca.bytes_sent == 0
    out = ca(rank_grad(comm.rank, 2))
    assert not ca.last_skipped and np.isfinite(out).all()


@pytest.mark.mpi(min_size=2)
def test_option_mismatch_raises_on_every_rank(comm):
    ratio = 0.02 if comm.rank == 0 else 0.01
    ca = CompressedAllreduce(make_compressor("topk", ratio=ratio), comm)
    with pytest.raises(MismatchError, match="differ"):
        ca(rank_grad(comm.rank, 0))


@pytest.mark.mpi(min_size=2)
def test_bad_input_on_one_rank_raises_everywhere(comm):
    ca = CompressedAllreduce(make_compressor("qsgd"), comm)
    g = rank_grad(comm.rank, 0)
    if comm.rank == 1:
        with pytest.raises(ValueError, match="1-D"):
            ca(g.reshape(-1, 1))
    else:
        with pytest.raises(RemoteError, match="rank\\(s\\) 1"):
            ca(g)


def test_state_dict_round_trip(comm):
    a = CompressedAllreduce(make_compressor("powersgd", rank=2), comm)
    for step in range(2):
        a(rank_grad(comm.rank, step), LAYOUT)
    b = CompressedAllreduce(make_compressor("powersgd", rank=2), comm)
    b.load_state_dict(a.state_dict())
    g = rank_grad(comm.rank, 7)
    assert np.array_equal(a(g, LAYOUT), b(g, LAYOUT))
    assert a.total_bytes_sent == b.total_bytes_sent


@pytest.mark.parametrize("name,opts", [("powersgd", {"rank": 2}), ("topk", {"ratio": 0.05})])
def test_buckets_keep_their_own_state(comm, name, opts):
    """The engine's interface: buckets of one flat buffer, each with its own residual."""
    p = comm.size
    split = LAYOUT["fc.weight"].offset
    ca = CompressedAllreduce(make_compressor(name, **opts), comm)
    sep = [CompressedAllreduce(make_compressor(name, **opts), comm) for _ in range(2)]
    lays = [LAYOUT.subset(["conv.weight", "conv.bias"]), LAYOUT.subset(["fc.weight", "fc.bias"])]
    for step in range(3):
        flat = rank_grad(comm.rank, step)
        outs = [ca.allreduce_async(flat[lo:hi], op="sum", layout=LAYOUT).wait()
                for lo, hi in ((0, split), (split, LAYOUT.numel))]
        refs = [s(flat[lo:hi].copy(), lay) for s, lay, (lo, hi)
                in zip(sep, lays, ((0, split), (split, LAYOUT.numel)))]
        for out, ref in zip(outs, refs):
            assert np.allclose(out, ref * p, rtol=1e-5, atol=1e-6)
    sd = ca.state_dict()
    assert [key for key, _, _ in sd["buffers"]] == [[0, split], [split, LAYOUT.numel - split]]
    with pytest.raises(ValueError, match="whole segments"):
        ca.allreduce_async(flat[1:split], layout=LAYOUT)


def test_bad_options_rejected(comm):
    with pytest.raises(TypeError, match="make_compressor"):
        CompressedAllreduce("topk", comm)
    with pytest.raises(ValueError, match="aggregates by"):
        CompressedAllreduce(make_compressor("topk"), comm, algorithm="linear")
    with pytest.raises(ValueError, match="aggregates by"):
        CompressedAllreduce(make_compressor("powersgd"), comm, algorithm="ring")
    with pytest.raises(ValueError, match="algorithm must be"):
        CompressedAllreduce(make_compressor("sign"), comm, algorithm="tree")
    with pytest.raises(ValueError, match="warmup_steps"):
        CompressedAllreduce(make_compressor("sign"), comm, warmup_steps=-1)
    with pytest.raises(ValueError, match="nonfinite"):
        CompressedAllreduce(make_compressor("sign"), comm, nonfinite="ignore")


def test_pack_unpack_round_trip():
    arrays = (np.arange(5, dtype=np.float32), np.arange(3, dtype=np.uint8),
              np.array([7], dtype=np.int32), np.arange(4, dtype=np.uint64))
    buf = pack(arrays)
    assert buf.nbytes == 8 * 4 + 24 + 8 + 8 + 32
    back = unpack(buf, [a.dtype for a in arrays])
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(arrays, back))


@pytest.mark.parametrize("name,opts", CONFIGS + [("powersgd", {"rank": 2, "factors": "float16"})])
@pytest.mark.parametrize("warmup", [0, 1])
def test_inplace_writes_the_same_sum_into_the_buffer(comm, name, opts, warmup):
    """inplace=True: wait() returns the caller's buffer holding what the out-of-place call
    returns (PowerSGD decompresses straight into it); the input is read before it is
    written, through warm-up and compressed steps and the residuals alike."""
    ours = CompressedAllreduce(make_compressor(name, **opts), comm, warmup_steps=warmup)
    ref = CompressedAllreduce(make_compressor(name, **opts), comm, warmup_steps=warmup)
    for step in range(3):
        buf = rank_grad(comm.rank, step)
        expected = ref.allreduce_async(buf.copy(), op="sum", layout=LAYOUT).wait()
        out = ours.allreduce_async(buf, op="sum", layout=LAYOUT, inplace=True).wait()
        assert out is buf
        assert np.allclose(buf, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
