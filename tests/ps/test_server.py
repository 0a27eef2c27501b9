"""Parameter server over MPI RMA: exact sums under concurrency (ASP, SSP, BSP), BSP equals
data-parallel SGD, SSP's bound, failures that raise on every rank instead of hanging."""
import numpy as np
import pytest

from mpidist.errors import MismatchError, RemoteError
from mpidist.ps import Consistency, ParameterServer, Straggler, place_servers
from mpidist.ps.consistency import StalenessRecord, format_histogram
from mpidist.ps.windows import pack_ticket, unpack_ticket


# ---------------------------------------------------------------- pure parts (any rank count)
def test_place_servers_spreads_over_nodes_highest_ranks_first():
    assert place_servers([0, 0, 0, 0], 1) == [3]
    assert place_servers([0, 0, 0, 0], 2) == [2, 3]
    assert place_servers([0, 0, 1, 1], 2) == [1, 3]
    assert place_servers([0, 0, 0, 1, 1, 1], 3) == [1, 2, 5]
    for bad in (0, 4, 2.0, True):
        with pytest.raises(ValueError):
            place_servers([0, 0, 0, 0], bad)


def test_ticket_roundtrip():
    for epoch, entries in ((0, 0), (1, 3), (12345, 2**31 - 1)):
        assert unpack_ticket(pack_ticket(epoch, entries)) == (epoch, entries)


def test_consistency_rules_and_parsing():
    assert Consistency.parse("SSP(3)") == Consistency("ssp", 3)
    assert Consistency.parse("asp") == Consistency("asp", 0)
    with pytest.raises(ValueError):
        Consistency("bsp", 2)
    with pytest.raises(ValueError):
        Consistency("hogwild")
    bsp, asp, ssp = Consistency("bsp"), Consistency("asp"), Consistency("ssp", 2)
    assert not bsp.server_ready(2, 3) and bsp.server_ready(3, 3)
    assert asp.server_ready(1, 3) and not asp.server_ready(0, 3)
    assert bsp.must_wait(clock=5, version=4, min_applied=0) and not bsp.must_wait(5, 5, 0)
    assert not asp.must_wait(100, 0, 0)
    assert ssp.must_wait(clock=5, version=0, min_applied=2) and not ssp.must_wait(5, 0, 3)


def test_straggler_persistent_or_rotating():
    fixed = Straggler(worker=2, delay=0.0)
    assert [fixed.slow(w, 7, 4) for w in range(4)] == [False, False, True, False]
    rotating = Straggler(worker=None, delay=0.0, seed=1)
    chosen = [[w for w in range(4) if rotating.slow(w, t, 4)] for t in range(40)]
    assert all(len(c) == 1 for c in chosen)          # exactly one slow worker per step
    assert len({c[0] for c in chosen}) == 4          # and it moves around
    with pytest.raises(ValueError):
        Straggler(worker=-1, delay=0.1)


def test_staleness_record_histogram():
    rec = StalenessRecord(staleness=[0, 0, 2, 1, 0], gaps=[(3, 1), (4, 4)])
    assert rec.histogram().tolist() == [3, 1, 1]
    assert rec.histogram(5).tolist() == [3, 1, 1, 0, 0]
    assert rec.max_gap() == 2
    assert "60.0%" in format_histogram(rec.histogram())


# ---------------------------------------------------------------- MPI
def _pushes(w, t, n):
    """Worker w's t-th push: integers, different per worker, step and element."""
    return (w + 1) * (t + 1) + (np.arange(n) % 7) * (w + 2)


def _expected(W, K, n):
    return sum(_pushes(w, t, n) for w in range(W) for t in range(K)).astype(np.float64)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("model", ["asp", "ssp", "bsp"])
def test_integer_pushes_sum_exactly(comm, model):
    """Many concurrent pushes from every worker land exactly once on 1 and on S servers."""
    n, K = 1001, 40
    rng = np.random.default_rng(comm.rank)
    for servers in sorted({1, min(2, comm.size - 1)}):
        ps = ParameterServer(np.zeros(n), comm=comm, servers=servers, consistency=model,
                             staleness=1 if model == "ssp" else None, average=False, timeout=30)
        with ps:
            w = ps.worker_index
            ps.run(lambda p, t: (rng.random() < 0.2 and __import__("time").sleep(1e-4))
                   or _pushes(w, t, n), K)
            pulled = ps.worker.pull_final() if ps.worker is not None else None
            final = ps.parameters()
            stats = ps.stats()
        W = ps.num_workers
        np.testing.assert_array_equal(final, _expected(W, K, n))
        if pulled is not None:
            np.testing.assert_array_equal(pulled, final)
        assert sum(stats["pushes"]) == servers * W * K
        assert stats["staleness_histogram"].sum() == W * K
        if model == "bsp":
            assert stats["updates"] == [K] * servers
            assert stats["staleness_histogram"].tolist() == [W * K]


class _PlainSGD:
    """params -= lr * grads, in float64 (the reference applies the same formula)."""

    def __init__(self, lr):
        self.lr = lr

    def step(self, params, grads):
        params -= self.lr * grads


@pytest.mark.mpi(min_size=2)
def test_bsp_equals_data_parallel_sgd(comm):
    """BSP on the servers == single-process SGD on the mean of the workers' gradients."""
    rng = np.random.default_rng(0)
    d, rows, steps, lr = 13, 24, 25, 0.05
    X = rng.normal(size=(comm.size * rows, d))
    y = X @ rng.normal(size=d) + 0.1 * rng.normal(size=len(X))
    w0 = rng.normal(size=d + 1)

    def grad(wb, xb, yb):                      # least squares with a bias, mean over rows
        r = xb @ wb[:d] + wb[d] - yb
        return np.concatenate([xb.T @ r, [r.sum()]]) / len(xb)

    servers = 1 if comm.size < 4 else 2
    with ParameterServer(w0.copy(), comm=comm, servers=servers, consistency="bsp",
                         optimizer=lambda off, cnt: _PlainSGD(lr), timeout=30) as ps:
        W, w = ps.num_workers, ps.worker_index
        def local(params, t):                  # worker w's rows of step t's global batch
            lo = ((t * W + w) * rows) % len(X)
            return grad(params, X[lo:lo + rows], y[lo:lo + rows])
        ps.run(local, steps)
        final = ps.parameters()
    ref = w0.copy()
    for t in range(steps):
        g = np.mean([grad(ref, X[((t * W + k) * rows) % len(X):][:rows],
                          y[((t * W + k) * rows) % len(X):][:rows]) for k in range(W)], axis=0)
        ref -= lr * g
    np.testing.assert_allclose(final, ref, rtol=0, atol=1e-6)
    assert np.abs(final - w0).max() > 1e-2        # it did train


@pytest.mark.mpi(min_size=2)
def test_ssp_never_exceeds_the_bound(comm):
    """With a straggler, fast workers run ahead but never more than s clocks."""
    s, K = 2, 30
    with ParameterServer(np.zeros(64), comm=comm, consistency="ssp", staleness=s,
                         straggler=Straggler(worker=0, delay=2e-3), average=False,
                         timeout=30) as ps:
        ps.run(lambda p, t: np.ones(64), K)
        stats = ps.stats()
        gaps = comm.comm.allgather(ps.worker.record.gaps if ps.worker else [])
        final = ps.parameters()
    assert all(c - m <= s for g in gaps for c, m in g)
    assert sum(len(g) for g in gaps) == ps.num_workers * K
    assert stats["max_clock_gap"] <= s
    if ps.num_workers >= 2:
        assert stats["max_clock_gap"] == s       # the fast workers did run ahead
    np.testing.assert_array_equal(final, np.full(64, ps.num_workers * K))


@pytest.mark.mpi(min_size=2)
def test_asp_workers_do_not_wait_for_a_straggler(comm):
    K = 20
    with ParameterServer(np.zeros(8), comm=comm, consistency="asp",
                         straggler=Straggler(worker=0, delay=5e-3), average=False) as ps:
        ps.run(lambda p, t: np.ones(8), K)
        stats = ps.stats()
    assert stats["wait_time"] == [0.0] * ps.num_workers
    if ps.num_workers >= 2:
        assert stats["staleness_histogram"][1:].sum() > 0   # the straggler pushed stale grads


@pytest.mark.mpi(min_size=2)
def test_bsp_push_without_pull_is_refused(comm):
    with pytest.raises((RuntimeError, RemoteError)):
        with ParameterServer(np.zeros(4), comm=comm, consistency="bsp", timeout=20) as ps:
            if ps.worker is not None:
                ps.worker.pull()
                ps.worker.push(np.ones(4))
                ps.worker.push(np.ones(4))         # step 1 without its pull
            else:
                ps.serve()


@pytest.mark.mpi(min_size=3)
def test_bsp_step_mismatch_raises_on_every_rank(comm):
    """A worker that stops early makes BSP fail everywhere (no rank hangs)."""
    with pytest.raises((MismatchError, RuntimeError, RemoteError)):
        with ParameterServer(np.zeros(4), comm=comm, consistency="bsp", timeout=20) as ps:
            steps = 3 if ps.worker_index == 0 else 5
            ps.run(lambda p, t: np.ones(4), steps)


@pytest.mark.mpi(min_size=2)
def test_error_inside_with_block_frees_windows_and_raises_everywhere(comm):
    ps = ParameterServer(np.zeros(4), comm=comm, timeout=20)
    with pytest.raises((ValueError, RuntimeError, RemoteError)):
        with ps:
            if ps.worker_index == 0:
                raise ValueError("a worker failed")
            ps.run(lambda p, t: np.ones(4), 3)
    assert ps.closed
    ps.close()                                    # a second close is a no-op
    assert ps.windows.freed
    if ps.worker is not None:
        with pytest.raises(RuntimeError, match="freed"):
            ps.worker.pull()


def test_parameter_server_checks_its_arguments(comm):
    with pytest.raises(TypeError):
        ParameterServer([0.0, 1.0], comm=comm)
    with pytest.raises(TypeError):
        ParameterServer(np.zeros(4, np.int32), comm=comm)
    if comm.size == 1:
        with pytest.raises(ValueError, match="at least 2 ranks"):
            ParameterServer(np.zeros(4), comm=comm)
    else:
        with pytest.raises(ValueError, match="servers"):
            ParameterServer(np.zeros(4), comm=comm, servers=comm.size)


@pytest.mark.mpi(min_size=2)
def test_pulls_are_never_torn_and_never_go_back(comm):
    """ASP with pushes of ones: every pulled shard is constant (one version) and grows."""
    n, K = 200_000, 25
    with ParameterServer(np.zeros(n, np.float32), comm=comm, servers=min(2, comm.size - 1),
                         consistency="asp", average=False) as ps:
        bad = 0
        if ps.is_server:
            ps.serve()
        else:
            last = np.zeros(len(ps.shards))
            for _ in range(K):
                p = ps.worker.pull()
                for i, (off, cnt) in enumerate(ps.shards):
                    shard = p[off:off + cnt]
                    bad += int(shard.min() != shard.max() or shard[0] < last[i])
                    last[i] = shard[0]
                ps.worker.push(np.ones(n, np.float32))
            ps.worker.finish()
            final = ps.worker.pull_final()           # waits until every push is applied
            assert ps.worker.global_clock() == K and (final == ps.num_workers * K).all()
    assert bad == 0


@pytest.mark.mpi(min_size=2)
def test_a_silent_server_makes_workers_time_out_not_hang(comm):
    """The server never serves (as if it had died): the workers' bounded waits raise."""
    import time
    t0 = time.monotonic()
    with pytest.raises((RuntimeError, RemoteError), match="timed out|failed"):
        with ParameterServer(np.zeros(4), comm=comm, consistency="bsp", timeout=1.5) as ps:
            if ps.worker is not None:
                ps.run(lambda p, t: np.ones(4), 3)
    assert time.monotonic() - t0 < 30


@pytest.mark.mpi(min_size=2)
def test_push_and_pull_name_the_arrays_they_take(comm):
    """A wrong gradient or out raises on the worker, before any RMA (the with block then
    ends the job everywhere: the servers see the worker fail instead of waiting)."""
    with pytest.raises((ValueError, RuntimeError, RemoteError)) as info:
        with ParameterServer(np.zeros(4), comm=comm, consistency="asp", timeout=20) as ps:
            if ps.worker is not None:
                ps.worker.pull(out=np.zeros(4, np.float32))
            ps.run(lambda p, t: np.ones(4), 1)
    if ps.worker is not None:
        assert "NumPy or CuPy array of shape (4,)" in str(info.value)
    with pytest.raises((ValueError, RuntimeError, RemoteError)) as info:
        with ParameterServer(np.zeros(4), comm=comm, consistency="asp", timeout=20) as ps:
            ps.run(lambda p, t: [1.0, 2.0, 3.0, 4.0], 1)
    if ps.worker is not None:
        assert "grad must be a NumPy or CuPy array of shape (4,), got list" in str(info.value)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_cupy_gradients_and_parameters_stage_through_host(comm):
    """Workers push CuPy gradients and pull into CuPy arrays: the sums are exact."""
    import cupy as cp
    n, K = 257, 6
    with ParameterServer(np.zeros(n), comm=comm, consistency="bsp", average=False,
                         timeout=30) as ps:
        w = ps.worker_index
        ps.run(lambda p, t: cp.asarray(_pushes(w, t, n), dtype=cp.float64), K)
        out = cp.zeros(n, cp.float64)
        pulled = ps.worker.pull_final(out=out) if ps.worker is not None else None
        final = ps.parameters()
    np.testing.assert_array_equal(final, _expected(ps.num_workers, K, n))
    if pulled is not None:
        assert pulled is out
        np.testing.assert_array_equal(cp.asnumpy(pulled), final)
