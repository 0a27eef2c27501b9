"""The compressed reduce-scatter on real ranks: each owner's piece equals the
decompress-then-sum reference of every rank's piece; error feedback loses nothing; warm-up,
inf/NaN, refusals. Expected values in terms of `size`: passes at any rank count."""
import numpy as np
import pytest

from mpidist.compress import CompressedAllreduce, make_compressor
from mpidist.errors import RemoteError
from mpidist.partition import chunk, pieces

N = 3000
CONFIGS = [("topk", {"ratio": 0.05}), ("topk", {"ratio": 0.05, "momentum": 0.9}),
           ("randomk", {"ratio": 0.1}), ("sign", {"chunk": 32}), ("qsgd", {"levels": 7}),
           ("fp16", {"error_feedback": True}), ("bf16", {})]
RANGES = [(0, N), (700, 1300), (2999, 1), (1000, 0)]


def grad(step, rank, m):
    return np.random.default_rng(100 * step + rank).standard_normal(m).astype(np.float32)


def mine(lo, m, rank, size):
    offset, count = chunk(N, rank, size)
    a, b = max(lo, offset), min(lo + m, offset + count)
    return a - lo, max(0, b - a)


def test_pieces_tile_the_range_in_rank_order():
    for size in (1, 2, 3, 4, 7):
        for lo, m in RANGES + [(5, 2990)]:
            got = pieces(lo, lo + m, N, size)
            assert [c for _, c in got] == [mine(lo, m, r, size)[1] for r in range(size)]
            ends = np.cumsum([0] + [c for _, c in got])
            assert ends[-1] == m and [s for s, _ in got] == list(ends[:-1])


@pytest.mark.parametrize("name,opts", CONFIGS)
@pytest.mark.parametrize("lo,m", RANGES)
def test_equals_decompress_then_sum_reference(comm, name, opts, lo, m):
    """Two calls (the second with error feedback's residuals in play): my piece is the sum
    over ranks, in rank order, of each rank's piece compressed on its own."""
    ca = CompressedAllreduce(make_compressor(name, **opts), comm)
    refs = [make_compressor(name, **opts) for _ in range(comm.size)]     # every rank's, replayed
    for step in range(2):
        out = ca.reduce_scatter(grad(step, comm.rank, m), lo=lo, n=N)
        start, count = mine(lo, m, comm.rank, comm.size)
        owned = pieces(lo, lo + m, N, comm.size)
        want = np.zeros(count, np.float32)
        for r, c in enumerate(refs):
            c.stream = r
            payload, ctx = c.compress_pieces(grad(step, r, m), owned)[comm.rank]
            c.decode_add(payload, ctx, want)
        assert out.dtype == np.float32 and out.shape == (count,)
        assert comm.all(np.array_equal(out, want)), name


@pytest.mark.parametrize("name,opts", [("topk", {"ratio": 0.02}), ("sign", {"chunk": 32}),
                                       ("randomk", {"ratio": 0.05})])
def test_error_feedback_loses_nothing(comm, name, opts):
    """Over calls: the owners' pieces plus every rank's residual add up to every gradient."""
    lo, m = 400, 2000
    ca = CompressedAllreduce(make_compressor(name, **opts), comm)
    got = np.zeros(m, np.float64)
    want = np.zeros(m, np.float64)
    start, count = mine(lo, m, comm.rank, comm.size)
    for step in range(4):
        g = grad(step, comm.rank, m)
        got[start:start + count] += ca.reduce_scatter(g, lo=lo, n=N)
        want += g
    total = comm.comm.allreduce(got) + comm.comm.allreduce(ca.compressor.residual.astype(np.float64))
    np.testing.assert_allclose(total, comm.comm.allreduce(want), rtol=1e-5, atol=1e-4)


def test_warmup_bytes_and_ranges_keep_their_own_state(comm):
    ca = CompressedAllreduce(make_compressor("topk", ratio=0.01), comm, warmup_steps=1)
    g = grad(0, comm.rank, 1000)
    start, count = mine(500, 1000, comm.rank, comm.size)
    dense = ca.reduce_scatter(g, lo=500, n=N)            # warm-up: the exact float32 sum
    exact = comm.comm.allreduce(g.astype(np.float64))[start:start + count]
    np.testing.assert_allclose(dense, exact, rtol=1e-5, atol=1e-5)
    sent_dense = comm.comm.allreduce(ca.bytes_sent)
    ca.reduce_scatter(g, lo=500, n=N)
    assert comm.comm.allreduce(ca.bytes_sent) < sent_dense or comm.size == 1
    ca.reduce_scatter(g[:200], lo=0, n=N)                # another range: its own compressor
    keys = sorted(key for key, _, _ in ca.state_dict()["buffers"])
    assert keys == [[0, 200], [500, 1000]]
    assert ca.step == 3


def test_nonfinite_skips_on_every_rank(comm):
    ca = CompressedAllreduce(make_compressor("topk", ratio=0.1), comm, nonfinite="skip")
    g = grad(0, comm.rank, N)
    if comm.rank == comm.size - 1:
        g[7] = np.nan
    out = ca.reduce_scatter(g, lo=0, n=N)
    assert ca.last_skipped and ca.skipped_steps == 1 and np.isnan(out).all()
    assert ca.compressor.residual is None              # nothing was compressed


def test_refusals_raise_on_every_rank(comm):
    ca = CompressedAllreduce(make_compressor("powersgd", rank=1), comm)
    with pytest.raises(ValueError, match="cannot reduce-scatter"):
        ca.reduce_scatter(grad(0, comm.rank, 100), lo=0, n=N)
    ca = CompressedAllreduce(make_compressor("topk"), comm)
    bad = N if comm.rank == 0 else 0                     # rank 0 alone passes a range past n
    with pytest.raises((ValueError, RemoteError), match="lo <= lo"):
        ca.reduce_scatter(grad(0, comm.rank, 100), lo=bad, n=N)
