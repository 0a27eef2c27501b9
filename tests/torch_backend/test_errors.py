"""What the backend does not do, or what the ranks disagree on, raises a clear error on every
rank; nothing hangs."""
import time

import pytest

torch = pytest.importorskip("torch", reason="needs torch (scripts/setup_env.sh installs it)")
import torch.distributed as dist  # noqa: E402


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
