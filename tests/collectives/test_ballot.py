"""The guard's ballot: a small native allreduce rides in the check's own message and gives
MPI_Allreduce's result; the record's size (small or
large) is agreed by every rank and follows the calls; the two-word form (no user op) checks
as well; mismatches across the carried sizes are caught; the ranks agree on the form."""
import time
import warnings

import numpy as np
import pytest

from .collectives_data import DTYPES, MPI_OPS, close, make, references
from mpidist.collectives import allgather, allreduce, ballot, core, flight, guard
from mpidist.comm import Communicator
from mpidist.errors import MismatchError

SIZES = (0, 1, 3, 54, 55, 255, 256, 257, 1000)  # float32: up to 54 fit a small record, 256 a large


@pytest.fixture(params=["carried", "plain"])
def ballot_comm(request, comm, monkeypatch):
    """comm's ranks on a fresh communicator, whose ballot carries data ("carried") or is
    the two-word MPI_MAX vote ("plain", as where ctypes can not reach the MPI library)."""
    if request.param == "plain":
        monkeypatch.setitem(ballot._shared, "made", "the test's plain form")
    c = Communicator(comm.comm)
    yield c
    c.free()


def _grid(comm):
    cases = []
    for dt in DTYPES:
        for op in MPI_OPS:
            for n in SIZES:
                cases.append((dt, op, n, make(comm.rank, dt, op, n, len(cases))))
    return cases


def test_allreduce_with_the_guard_on_equals_mpi(ballot_comm):
    comm = ballot_comm
    cases = _grid(comm)
    refs = references(comm, cases)
    bad = []
    for (dt, op, n, x), ref in zip(cases, refs):
        before = x.copy()
        got_out = allreduce(x, op=op, algorithm="native", comm=comm, out=np.full_like(x, 99))
        got_in = allreduce(x.copy(), op=op, algorithm="native", comm=comm)
        for how, got in (("out", got_out), ("in-place", got_in)):
            if got.dtype != dt or not close(got, ref):
                bad.append(f"{dt} {op} n={n} {how}")
        if not np.array_equal(x, before):
            bad.append(f"{dt} {op} n={n}: the input changed")
    assert not bad, f"{len(bad)} wrong cases, e.g. {bad[:5]}"


def _record(comm):
    """'small' or 'large': the size of comm's next ballot record, checked alike on every rank."""
    handles = ballot.of(comm).handles
    size = "large" if handles[ballot._NEXT] == handles[ballot._LARGE_TYPE] else "small"
    assert comm.comm.allgather(size) == [size] * comm.size
    return size


def _make_small(comm):
    """Enough checks that carry at most a small record's payload for the record to be small."""
    for _ in range(ballot.LINGER + 1):
        allreduce(np.ones(2, np.float32), algorithm="native", comm=comm)


@pytest.mark.mpi(min_size=2)
def test_small_allreduce_is_one_message(comm, monkeypatch):
    """With the guard on, a small native allreduce is done by the check itself: the
    algorithm is never run apart. Up to SMALL bytes always; up to CARRY bytes once a call
    of that size has made the record large."""
    c = Communicator(comm.comm)
    _make_small(c)
    y = np.arange(256, dtype=np.float32)
    allreduce(y.copy(), algorithm="native", comm=c)         # finds a small record
    def not_called(*args):
        raise AssertionError("the allreduce ran apart from the check")
    monkeypatch.setattr(core, "run_allreduce", not_called)
    for n in (ballot.SMALL // 4, 256, ballot.SMALL // 4, 256):
        x = np.arange(n, dtype=np.float32)
        assert np.array_equal(allreduce(x, algorithm="native", comm=c), y[:n] * c.size)
    c.free()


@pytest.mark.mpi(min_size=2)
def test_the_record_size_follows_the_calls(comm):
    """Every rank agrees on the next record's size: large right after a call that needs it,
    small again after LINGER checks that do not."""
    c = Communicator(comm.comm)
    assert _record(c) == "large"
    _make_small(c)
    assert _record(c) == "small"
    allgather(np.ones(2, np.float32), comm=c)         # a check that carries nothing
    allreduce(np.ones(4096, np.float32), algorithm="native", comm=c)   # too large to ride
    assert _record(c) == "small"
    allreduce(np.ones(256, np.float32), algorithm="native", comm=c)
    assert _record(c) == "large"
    for _ in range(ballot.LINGER - 1):
        allgather(np.ones(2, np.float32), comm=c)
        assert _record(c) == "large"
    allgather(np.ones(2, np.float32), comm=c)
    assert _record(c) == "small"
    c.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("record", ["small", "large"])
def test_small_and_large_calls_mixed(comm, record):
    """Calls that need a large record after small ones, from either record size: the
    result is MPI_Allreduce's and the record ends large on every rank."""
    c = Communicator(comm.comm)
    if record == "small":
        _make_small(c)
    for n in (256, 2, 256):
        x = np.full(n, c.rank + 1, np.float32)
        allreduce(x, algorithm="native", comm=c)
        assert np.all(x == c.size * (c.size + 1) // 2)
    assert _record(c) == "large"
    c.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("record", ["small", "large"])
@pytest.mark.parametrize("mine,theirs", [(256, 257), (257, 256), (2, 3), (300, 301), (54, 55),
                                         (2, 256), (256, 2)])
def test_lengths_across_the_carried_size_raise_everywhere(ballot_comm, mine, theirs, record):
    """One rank's call rides in the ballot, the last rank's does not (or both, or neither;
    in a small record or a large one)."""
    comm = ballot_comm
    if record == "small":
        _make_small(comm)
    else:
        allreduce(np.ones(256, np.float32), algorithm="native", comm=comm)
    allreduce(np.ones(mine, np.float32), algorithm="native", comm=comm)
    n = theirs if comm.rank == comm.size - 1 else mine
    t0 = time.perf_counter()
    with pytest.raises(MismatchError, match=f"n={mine}.*n={theirs}|n={theirs}.*n={mine}"):
        allreduce(np.ones(n, np.float32), algorithm="native", comm=comm)
    assert time.perf_counter() - t0 < 2.0
    if ballot.of(comm).state is not None:
        _record(comm)                   # the next record's size is agreed all the same
    assert allreduce(np.ones(4), algorithm="native", comm=comm)[0] == comm.size


@pytest.mark.mpi(min_size=2)
def test_a_carried_call_against_another_collective(ballot_comm):
    """A rank in a small allreduce, the last rank in a vote-only check of another kind."""
    comm = ballot_comm
    with pytest.raises(MismatchError, match="allgather"):
        if comm.rank == comm.size - 1:
            allgather(np.ones(2, np.float32), comm=comm)
        else:
            allreduce(np.ones(2, np.float32), algorithm="native", comm=comm)


def test_guard_off_still_reduces(comm):
    old = guard.get_mode()
    guard.set_mode("off")
    try:
        assert allreduce(np.ones(5), algorithm="native", comm=comm)[0] == comm.size
    finally:
        guard.set_mode(old)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_one_flight_record_per_call(comm, dtype):
    """A call whose data rides in the ballot and one whose data can not (half precision is
    widened apart) each leave exactly one entry on the flight record."""
    allreduce(np.ones(4, dtype), algorithm="native", comm=comm)
    before = flight.records(comm)[-1]["seq"]
    allreduce(np.ones(4, dtype), algorithm="native", comm=comm)
    rec = flight.records(comm)
    assert rec[-1]["seq"] == before + 1 and "n=4" in rec[-1]["call"], rec[-3:]


def test_a_native_allreduce_of_nothing(ballot_comm):
    """n = 0, every dtype, in either form: an empty result, and the ranks still in step."""
    for dt in DTYPES:
        x = np.zeros(0, dt)
        assert allreduce(x, algorithm="native", comm=ballot_comm).shape == (0,)
        assert allreduce(x, op="max", algorithm="native", comm=ballot_comm,
                         out=np.zeros(0, dt)).size == 0
    assert allreduce(np.ones(3), algorithm="native", comm=ballot_comm)[0] == ballot_comm.size


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("odd", ["first", "last"])
def test_one_rank_in_the_other_form_agrees(comm, monkeypatch, odd):
    """One rank's environment asks for the plain form (MPIDIST_BALLOT=plain), the others can
    use the compiled one: the ranks agree on one form when the ballot is made (plain, with
    one warning, on rank 0), and the calls
    and the mismatch checks work. Never a hang: the test's timeout would fail it."""
    mine = comm.rank == (0 if odd == "first" else comm.size - 1)
    monkeypatch.delitem(ballot._shared, "made", raising=False)
    monkeypatch.delitem(ballot._shared, "warned", raising=False)
    if mine:
        monkeypatch.setenv("MPIDIST_BALLOT", "plain")
    else:
        monkeypatch.delenv("MPIDIST_BALLOT", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = Communicator(comm.comm)
        try:
            x = np.full(5, c.rank + 1.0)
            allreduce(x, algorithm="native", comm=c)
            assert np.all(x == c.size * (c.size + 1) / 2)
            forms = c.comm.allgather(ballot.of(c).state is None)
            with pytest.raises(MismatchError):
                allreduce(np.ones(2 if c.rank else 3), algorithm="native", comm=c)
        finally:
            c.free()
    assert forms == [True] * comm.size, forms
    ours = [w for w in caught if "compiled ballot" in str(w.message)]
    others_could = comm.comm.allreduce(0 if mine or isinstance(ballot._shared["made"], str) else 1)
    if comm.rank == 0 and others_could:
        assert len(ours) == 1, [str(w.message) for w in caught]
    else:
        assert not ours, [str(w.message) for w in ours]


def test_the_library_is_the_one_mpi4py_calls():
    """The compiled form's MPI_Allreduce is the one in the library that mpi4py's module uses
    (mpilib.path(): the file of the MPI_Init mpi4py resolves), found with no name scan."""
    import ctypes
    import os
    from mpi4py import MPI
    from mpidist import mpilib
    made = ballot._shared.get("made") or ballot._make_op()
    if isinstance(made, str):
        pytest.skip(f"the compiled form is not used here: {made}")
    info = mpilib._DlInfo()
    assert ctypes.CDLL(None).dladdr(ctypes.c_void_p(made[0]), ctypes.byref(info))
    assert os.path.realpath(info.fname.decode()) == mpilib.path() != ""
    assert os.path.basename(mpilib.path()).startswith("libmpi") or "mpi" in mpilib.path().lower()
    assert MPI.Get_library_version()
