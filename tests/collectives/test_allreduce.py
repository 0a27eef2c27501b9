"""Every allreduce algorithm against MPI_Allreduce over dtype x op x length, in place and
out of place, at any rank count; bitwise agreement of the result across ranks."""
import numpy as np
import pytest

from .collectives_data import DTYPES, MPI_OPS, close, digest, lengths, make, references
from mpidist.collectives import ALGORITHMS, allreduce, guard
from mpidist.comm import Communicator

ALL = list(ALGORITHMS) + ["auto"]


@pytest.fixture
def guard_off():
    """The grid makes every call a new signature; the guard has its own tests."""
    old = guard.get_mode()
    guard.set_mode("off")
    yield
    guard.set_mode(old)


def _grid(comm):
    cases = []
    for dt in DTYPES:
        for op in MPI_OPS:
            for n in lengths(comm.size):
                cases.append((dt, op, n, make(comm.rank, dt, op, n, len(cases))))
    return cases


@pytest.mark.parametrize("algorithm", ALL)
def test_matches_mpi_allreduce(comm, algorithm, monkeypatch, guard_off):
    monkeypatch.setenv("MPIDIST_SEGMENT_BYTES", "1024")  # several segments at n = 2003
    cases = _grid(comm)
    refs = references(comm, cases)
    bad = []
    for (dt, op, n, x), ref in zip(cases, refs):
        before = x.copy()
        out = np.full_like(x, 99)
        got_out = allreduce(x, op=op, algorithm=algorithm, comm=comm, out=out)
        got_in = allreduce(x.copy(), op=op, algorithm=algorithm, comm=comm)
        for how, got in (("out", got_out), ("in-place", got_in)):
            if got.dtype != dt or not close(got, ref):
                bad.append(f"{dt} {op} n={n} {how}")
        if got_out is not out or not np.array_equal(x, before):
            bad.append(f"{dt} {op} n={n}: out-of-place call did not leave its input alone")
    assert not bad, f"{algorithm}: {len(bad)} wrong cases, e.g. {bad[:5]}"


@pytest.mark.parametrize("segment", [None, "1024"])
@pytest.mark.parametrize("algorithm", ALL)
def test_same_bits_on_every_rank(comm, algorithm, segment, monkeypatch):
    """Random floats, so rounding differs with reduction order: all ranks must still agree,
    and in-place must equal out-of-place; whole messages and pipelined segments."""
    if segment:
        monkeypatch.setenv("MPIDIST_SEGMENT_BYTES", segment)
    rng = np.random.default_rng(comm.rank)
    results = []
    for dt in (np.float32, np.float16, np.float64):
        for op in ("sum", "avg", "prod"):
            x = rng.standard_normal(4099).astype(dt)
            a = allreduce(x, op=op, algorithm=algorithm, comm=comm, out=np.empty_like(x))
            b = allreduce(x.copy(), op=op, algorithm=algorithm, comm=comm)
            results += [a, b]
    same_inplace = all(np.array_equal(results[i], results[i + 1], equal_nan=True)
                       for i in range(0, len(results), 2))
    hashes = comm.comm.allgather(digest(*results))
    assert same_inplace and len(set(hashes)) == 1, \
        f"{algorithm}: results differ (in-place==out: {same_inplace}, hashes: {len(set(hashes))})"


def test_float_sum_within_rounding(comm):
    """Non-integer data: every algorithm within accumulated rounding of MPI_Allreduce."""
    x = np.random.default_rng([7, comm.rank]).standard_normal(3001).astype(np.float32)
    ref = np.empty(x.size, np.float64)
    comm.comm.Allreduce(x.astype(np.float64), ref)
    scale = np.abs(ref).max() + 1
    errs = {a: float(np.abs(allreduce(x, algorithm=a, comm=comm, out=np.empty_like(x))
                            .astype(np.float64) - ref).max() / scale) for a in ALL}
    tol = comm.size * np.finfo(np.float32).eps
    assert all(e <= tol for e in errs.values()), errs


def test_bad_arguments_raise_on_every_rank(comm):
    x = np.ones(5, np.float32)
    with pytest.raises(ValueError, match="valid algorithms: ring"):
        allreduce(x, algorithm="bogus", comm=comm)
    with pytest.raises(ValueError, match="valid ops: sum, avg"):
        allreduce(x, op="mean", comm=comm)
    with pytest.raises(TypeError, match="not supported"):
        allreduce(np.ones(5, np.complex64), comm=comm)
    with pytest.raises(TypeError, match="NumPy or CuPy array"):
        allreduce([1.0, 2.0], comm=comm)
    with pytest.raises(ValueError, match="C-contiguous"):
        allreduce(np.ones((4, 4), np.float32)[:, 1], comm=comm)
    y = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        allreduce(y[:5], comm=comm, out=y[2:7])
    with pytest.raises(TypeError, match="dtype"):
        allreduce(x, comm=comm, out=np.ones(5, np.float64))
    ro = np.ones(5, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        allreduce(ro, comm=comm)
    m = np.ones((2, 3), np.int64)
    assert allreduce(m, comm=comm, out=m) is m and np.all(m == comm.size)   # out=buf: in place


@pytest.mark.parametrize("pacing", ["on", "off"])
def test_paced_ring_matches_mpi_allreduce(comm, pacing, monkeypatch, guard_off):
    """The segmented ring with one send in flight (sends in order) or all of them."""
    monkeypatch.setenv("MPIDIST_SEGMENT_BYTES", "1024")
    monkeypatch.setenv("MPIDIST_RING_PACING", pacing)
    cases = [(np.dtype(dt), op, n, make(comm.rank, dt, op, n, i))
             for i, (dt, op, n) in enumerate((dt, op, n) for dt in (np.float64, np.int32)
                                             for op in ("sum", "max") for n in (2003, 9001))]
    bad = [f"{dt} {op} n={n}" for (dt, op, n, x), ref in zip(cases, references(comm, cases))
           if not close(allreduce(x, op=op, algorithm="ring", comm=comm,
                                  out=np.empty_like(x)), ref)]
    assert not bad, bad


@pytest.mark.mpi(min_size=2)
def test_ring_paces_across_nodes_after_a_slow_segment(comm, monkeypatch):
    """auto paces only between nodes, and only once a step measured its segments as slow;
    a measurement is taken from the second step on; a bad setting is refused everywhere."""
    from mpidist.collectives import ring
    monkeypatch.setenv("MPIDIST_SEGMENT_BYTES", "1024")
    sub = Communicator(comm.comm, ranks_per_node=1)      # every rank its own (simulated) node
    try:
        assert not ring.paced(sub)                       # nothing measured yet
        x = np.ones(20000, np.float32)
        allreduce(x, algorithm="ring", comm=sub, out=np.empty_like(x))
        assert sub in ring._segment_seconds
        slow, fast = 2 * ring.PACE_ABOVE, ring.PACE_ABOVE / 2
        ring._segment_seconds[sub] = (slow, slow)
        assert ring.paced(sub) and (comm.num_nodes > 1 or not ring.paced(comm))
        ring._segment_seconds[sub] = (fast, fast)
        assert not ring.paced(sub)
        ring._segment_seconds[sub] = (slow, fast)               # one slow step alone
        assert not ring.paced(sub)
        monkeypatch.setenv("MPIDIST_RING_PACING", "sometimes")
        with pytest.raises(ValueError, match="MPIDIST_RING_PACING must be one of auto, on, off"):
            allreduce(x, algorithm="ring", comm=sub, out=np.empty_like(x))
    finally:
        sub.free()
