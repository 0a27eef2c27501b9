"""The mismatch guard: disagreeing ranks raise a clear error on every rank, never hang,
whichever call they disagree on."""
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import threads
from mpidist.collectives import allgather, allreduce, allreduce_async, flight, guard, reduce_scatter
from mpidist.errors import MismatchError, RemoteError


def _odd_call(comm, what: str, last: bool, small: bool = False):
    """One call, the same on every rank but the last unless what is 'none'. small: a native
    allreduce of 1 KiB (MPI_Allreduce itself after the check) instead of a ring of 4 KB."""
    n = 256 + (what == "length" and last) if small else 1000 - (what == "length" and last)
    dt = np.float64 if what == "dtype" and last else np.float32
    op = "max" if what == "op" and last else "sum"
    algorithm = "tree" if what == "algorithm" and last else "native" if small else "ring"
    x = np.ones(n, dt)
    if what == "call" and last:
        return reduce_scatter(x, op=op, comm=comm)
    return allreduce(x, op=op, algorithm=algorithm, comm=comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what", ["length", "dtype", "op", "algorithm", "call"])
@pytest.mark.parametrize("after", [0, 5])
@pytest.mark.parametrize("small", [False, True], ids=["ring", "native"])
def test_mismatch_raises_on_every_rank(comm, what, after, small):
    """A differing call raises everywhere, also after `after` matching calls of the same
    signature (the ranks that saw it before check it again)."""
    allreduce(np.ones(1), comm=comm)      # the ballot made (compiled, if its source changed)
    for _ in range(after):
        _odd_call(comm, "none", False, small)
    last = comm.rank == comm.size - 1
    t0 = time.perf_counter()
    with pytest.raises(MismatchError) as err:
        _odd_call(comm, what, last, small)
    assert time.perf_counter() - t0 < 2.0
    msg = str(err.value)
    assert f"ranks {comm.size - 1}:" in msg and "ranks 0" in msg, msg
    # the communicator is still usable afterwards
    assert allreduce(np.ones(3), comm=comm)[0] == comm.size


@pytest.mark.mpi(min_size=2)
def test_call_order_swapped_after_matching_calls(comm):
    """Two signatures seen before, called in another order on one rank: caught."""
    a, b = np.ones(8, np.float32), np.ones(9, np.float32)
    for _ in range(3):
        allreduce(a, comm=comm)
        allreduce(b, comm=comm)
    first, second = (b, a) if comm.rank == comm.size - 1 else (a, b)
    with pytest.raises(MismatchError, match="n=8.*n=9|n=9.*n=8"):
        allreduce(first, comm=comm)


@pytest.mark.mpi(min_size=2)
def test_async_mismatch_raises_on_every_rank(comm):
    grads = [np.ones(10, np.float32), np.ones(20 + (comm.rank == 0), np.float32)]
    with pytest.raises(MismatchError, match="buckets"):
        allreduce_async(grads, comm=comm, bucket_bytes=40).wait()


@pytest.mark.mpi(min_size=2)
def test_a_single_async_call_is_checked_on_its_worker(comm):
    # one array: checked by the worker thread (patient), raised by wait() on every rank
    x = np.ones(30 + (comm.rank == comm.size - 1), np.float32)
    with pytest.raises(MismatchError, match="n=30.*n=31|n=31.*n=30"):
        allreduce_async(x, comm=comm).wait()
    y = allreduce_async(np.ones(30, np.float32), comm=comm).wait()      # and goes on
    assert np.all(y == comm.size)


@pytest.mark.mpi(min_size=2)
def test_queued_async_calls_are_checked_each_in_its_turn(comm):
    # three calls queued on the worker, the middle one differing on the last rank: its
    # vote is posted while the first still runs; it alone raises, on every rank, and the
    # calls around it are summed
    last = comm.rank == comm.size - 1
    a = np.ones(1 << 16, np.float32)
    b = np.ones(40 + last, np.float32)
    c = np.full(50, 2.0, np.float32)
    handles = [allreduce_async(x, comm=comm, algorithm="ring") for x in (a, b, c)]
    assert np.all(handles[0].wait() == comm.size)
    with pytest.raises(MismatchError, match="n=40.*n=41|n=41.*n=40"):
        handles[1].wait()
    assert np.all(handles[2].wait() == 2 * comm.size)


@pytest.mark.mpi(min_size=2)
def test_a_posted_vote_goes_out_at_once(comm):
    # between two ranks the whole vote is one exchange, sent by post(): it completes by
    # MPI's progress alone (here tests of its receive), before finish() is called
    pair = comm.split(0 if comm.rank < 2 else 1, comm.rank)
    if comm.rank < 2:
        posted = guard.post(pair, ("allreduce", ("n", 4)))
        deadline = time.monotonic() + 10
        while not posted.vote.pending.Test():
            assert time.monotonic() < deadline, "the vote did not arrive"
            time.sleep(1e-3)
        flight.end(posted.finish())
    pair.free()


@pytest.mark.mpi(min_size=2)
def test_votes_in_flight_together_each_decide_alone(comm):
    # several votes posted before any is finished (as the worker's queued jobs), every
    # other one differing on the last rank: finished in order, each agrees or raises on
    # every rank, at any rank count (recursive doubling folds the ranks beyond a power of 2)
    votes = comm.split(7, comm.rank)
    last = comm.rank == comm.size - 1
    signatures = [("allreduce", ("n", 10 + k + (last and k % 2))) for k in range(5)]
    posted = [guard.post(votes, sig) for sig in signatures]
    for k, p in enumerate(posted):
        if k % 2:
            a, b = f"n={10 + k}", f"n={11 + k}"
            with pytest.raises(MismatchError, match=f"{a}.*{b}|{b}.*{a}"):
                p.finish()
        else:
            entry = p.finish()
            assert entry[1] == signatures[k] and entry[3] is None   # running until it ends
            flight.end(entry)
    assert all(c["end"] is not None for c in flight.records(votes)[-5:])
    votes.free()


@pytest.mark.mpi(min_size=2)
def test_a_worker_waiting_for_a_late_rank_leaves_the_core(comm, monkeypatch):
    # ranks sharing cores; rank 0 comes 0.4 s late; the others' workers wait for it in the
    # guard's check with naps, not spinning in the ballot's MPI_Allreduce (which would cost
    # about 0.4 s of CPU time each, although their main threads only block in wait(): the
    # core they would spin on is one the late rank may need)
    monkeypatch.setattr(threads, "core_per_rank", lambda: False)
    late = 0.4
    allreduce_async(np.ones(8), comm=comm).wait()         # the worker and its ballot exist
    comm.comm.Barrier()
    if comm.rank == 0:
        time.sleep(late)
    cpu = time.process_time()
    h = allreduce_async(np.ones(8), comm=comm)
    assert np.all(h.wait() == comm.size)
    spent = time.process_time() - cpu
    if comm.rank != 0:
        assert spent < 0.25 * late, f"{spent:.3f} s of CPU while waiting {late} s"


@pytest.mark.mpi(min_size=2)
def test_bad_argument_on_one_rank_raises_everywhere(comm):
    x = np.ones(4, np.complex64 if comm.rank == 0 else np.float32)
    expected = TypeError if comm.rank == 0 else RemoteError
    with pytest.raises(expected, match="not supported" if comm.rank == 0 else "rank"):
        allreduce(x, comm=comm)


def test_modes():
    old = guard.get_mode()
    try:
        for name, mode in (("first", "on"), ("always", "on"), ("0", "off"), ("on", "on")):
            guard.set_mode(name)
            assert guard.get_mode() == mode
    finally:
        guard.set_mode(old)
    with pytest.raises(ValueError, match="on, off"):
        guard.set_mode("sometimes")


def test_flight_recorder_keeps_each_call(comm):
    """Each checked call is on the record, with its sequence number and both times."""
    before = flight.records(comm)
    allreduce(np.ones(7, np.float32), algorithm="native", comm=comm)
    allgather(np.ones(3, np.int64), comm=comm)
    h = allreduce_async(np.ones(5), comm=comm)
    h.wait()
    reduce_scatter(np.ones(2 * comm.size), comm=comm)
    rec = flight.records(comm)[-4:]
    assert [r["call"].split("(")[0] for r in rec] == \
        ["allreduce", "allgather", "allreduce_async", "reduce_scatter"]
    assert "n=7" in rec[0]["call"] and "dtype=float32" in rec[0]["call"]
    seqs = [r["seq"] for r in rec]
    assert seqs == list(range(seqs[0], seqs[0] + 4))
    assert not before or seqs[0] > before[-1]["seq"]
    deadline = time.time() + 5              # the async call's end is set by its worker
    while rec[2]["end"] is None and time.time() < deadline:
        time.sleep(0.01)
        rec = flight.records(comm)[-4:]
    assert all(r["end"] is not None and r["end"] >= r["start"] for r in rec), rec


def test_guard_off_records_nothing(comm):
    old = guard.get_mode()
    guard.set_mode("off")
    try:
        n = len(flight.records(comm))
        allreduce(np.ones(3), comm=comm)
        assert len(flight.records(comm)) == n
    finally:
        guard.set_mode(old)


def _dump(rank, calls, members=(0, 1, 2, 3)):
    return {"job": "j", "rank": rank, "comms": [{"key": "0-3", "members": list(members),
                                                 "calls": calls}]}


def test_diagnose_names_the_divergent_call():
    """Ranks 0-2 wait in allreduce #5; rank 3 skipped it and waits in a barrier #5."""
    done = [[s, "allreduce(n=1000)", 1.0, 2.0] for s in (3, 4)]
    dumps = [_dump(r, done + [[5, "allreduce(n=1000)", 3.0, None]]) for r in range(3)]
    dumps.append(_dump(3, done + [[5, "barrier()", 3.0, None]]))
    text = flight.diagnose(dumps, "0-3")
    assert "ranks 0-2 are in allreduce(n=1000) #5" in text, text
    assert "rank 3 is in barrier() #5" in text, text
    assert "first call where ranks differ is #5: ranks 0-2: allreduce(n=1000); ranks 3: barrier()" in text


def test_diagnose_a_rank_that_stopped_calling():
    done = [[s, "allreduce(n=8)", 1.0, 2.0] for s in (1, 2)]
    dumps = [_dump(r, done + [[3, "allreduce(n=8)", 3.0, None]], (0, 1, 2)) for r in range(2)]
    dumps.append(_dump(2, done, (0, 1, 2)))
    text = flight.diagnose(dumps, "0-3")
    assert "ranks 0-1 are in allreduce(n=8) #3" in text
    assert "rank 2 is in no collective; the last was allreduce(n=8) #2" in text
    assert "#3: ranks 0-1: allreduce(n=8); ranks 2: (no call)" in text
    dumps.pop()                        # rank 2 finished and left nothing
    assert "rank 2 left no record" in flight.diagnose(dumps, "0-3")


def test_bench_guard_measures_each_variant(comm):
    """bench guard's measure times the bare call and the guard off and on (figures not
    checked), and leaves the guard's mode as it found it."""
    from mpidist.bench import guard as bench
    mode = guard.get_mode()
    t = bench.measure(comm, [8, 1024], calls=10, rounds=2)
    assert set(t) == {"MPI_Allreduce", "guard off", "guard on"} and min(t.values()) > 0
    assert guard.get_mode() == mode


def test_bench_guard_prints_a_row_per_size_and_the_mixed_row(capsys):
    """`mpidist bench guard` (on the world, as the command runs) prints one row per size
    and one for the mixed cycle."""
    from mpidist.bench import guard as bench
    assert bench.main(["--sizes", "8", "--mixed", "8+1K", "--calls", "10", "--rounds", "2"]) == 0
    if MPI.COMM_WORLD.rank == 0:
        rows = capsys.readouterr().out.splitlines()[2:]
        assert [r.split()[0] for r in rows] == ["8", "8+1024"], rows
