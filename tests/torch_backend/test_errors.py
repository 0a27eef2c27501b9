"""What the backend does not do, or what the ranks disagree on, raises a clear error on every
rank; nothing hangs."""
import time

import pytest

torch = pytest.importorskip("torch", reason="needs torch (scripts/setup_env.sh installs it)")
import torch.distributed as dist  # noqa: E402

from mpidist.collectives import flight, node, select  # noqa: E402
from mpidist.collectives.node import reductions  # noqa: E402
from mpidist.comm import Communicator  # noqa: E402
from mpidist.torch.backend import Group  # noqa: E402


def test_unimplemented_collective_names_itself(groups):
    """recv from any source is not implemented: torch's message names it and the backend."""
    with pytest.raises(RuntimeError, match="mpidist.*recvAnysource|recvAnysource.*mpidist"):
        dist.recv(torch.empty(3))


def test_unsupported_op_and_dtype_raise_on_every_rank(groups):
    with pytest.raises(RuntimeError, match="BAND"):
        dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND)
    with pytest.raises(RuntimeError, match="contiguous"):
        dist.all_reduce(torch.ones(4, 4).t())
    t = torch.ones(4, dtype=torch.int64)              # the backend still works afterwards
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), dist.get_world_size()))


def test_bitwise_ops_on_integers(groups):
    """BAND/BOR/BXOR on integers go to MPI's reduction (gloo gives the same)."""
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        t = torch.tensor([1 << dist.get_rank(), 7, 255], dtype=torch.int32)
        ref = t.clone()
        dist.all_reduce(t, op=op)
        dist.all_reduce(ref, op=op, group=groups[1])
        assert torch.equal(t, ref)


@pytest.mark.mpi(min_size=2)
def test_mismatched_collectives_raise_on_every_rank(groups):
    """The last rank broadcasts while the others all-reduce: all raise, naming both calls."""
    t = torch.ones(8)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="disagree|rejected"):
        if dist.get_rank() == dist.get_world_size() - 1:
            dist.broadcast(t, 0)
        else:
            dist.all_reduce(t)
    assert time.perf_counter() - t0 < 30
    dist.all_reduce(t)                                 # and the group is still usable
    assert t[0].item() == dist.get_world_size()


@pytest.mark.parametrize("algorithm", ["auto", "shm", "ring"])
def test_each_call_is_checked_once_and_auto_asks_the_table(comm, algorithm, monkeypatch):
    """One flight record (one check) per collective, a window that grows included; the
    window reduces an allreduce where the group's algorithm is shm, "auto" where the
    decision table (or the rule) says shm, as for every collective."""
    g = Group(Communicator(comm.comm), algorithm)
    windowed, finish = [], reductions.finish

    def counted(w, call):
        windowed.append(call.x.size)
        finish(w, call)
    monkeypatch.setattr(reductions, "finish", counted)
    sizes, errors = (10, 300_001, 5, 700_003), []
    expect = [n for n in sizes if node.usable(g.comm) and (
        algorithm == "shm" or algorithm == "auto" and select.choose(g.comm, 4 * n) == "shm")]
    for n in sizes:
        g.allreduce(errors.append, "sum", None, [torch.ones(n)])
    g.broadcast(errors.append, [torch.ones(3)], 0, 0)
    g.reduce_scatter_base(errors.append, "sum", None, torch.empty(4), torch.ones(4 * g.size))
    g.barrier(errors.append)
    g.shutdown()                                       # after the queued calls
    calls = [r["call"].split("(")[0] for r in flight.records(g.comm)]
    assert errors == [None] * 7
    assert calls == ["torch.allreduce"] * 4 + ["torch.broadcast", "torch.reduce_scatter",
                                               "torch.barrier"], calls
    assert windowed == expect


@pytest.mark.mpi(min_size=2)
def test_a_worker_waiting_for_a_late_rank_across_nodes_leaves_the_core(comm):
    """Nodes of one rank (no shared window): the group's worker waits for a late rank in
    the guard's check and the ring with naps, not spinning in MPI, so the CPU time it takes
    is a small part of the wait (a spinning worker takes about all of it)."""
    g = Group(Communicator(comm.comm, ranks_per_node=1))
    errors, late = [], 0.4
    try:
        done = []
        g.allreduce(done.append, "sum", None, [torch.ones(1 << 18)])   # the worker, the ballot
        while not done:
            time.sleep(1e-3)
        comm.comm.Barrier()
        if comm.rank == 0:
            time.sleep(late)
        t, done = torch.ones(1 << 18), []
        cpu = time.process_time()
        g.allreduce(done.append, "sum", None, [t])
        while not done:
            time.sleep(1e-3)
        spent = time.process_time() - cpu
        errors += done
    finally:
        g.shutdown()
    assert errors == [None] and t[0].item() == comm.size
    if comm.rank != 0:
        assert spent < 0.25 * late, f"{spent:.3f} s of CPU while waiting {late} s"
