"""Compression on the hop between nodes only (MPIDIST_RANKS_PER_NODE-style splits of this
job): the exact sum within each node, then the leaders' compressed allreduce, on every rank."""
import numpy as np
import pytest
from mpi4py import MPI

from mpidist.comm import Communicator
from mpidist.compress import CompressedAllreduce, make_compressor
from mpidist.compress.hierarchical import NodeCompressedAllreduce, spans_nodes


@pytest.mark.parametrize("per_node", [1, 2, 3])
@pytest.mark.parametrize("name", ["sign", "fp16"])
def test_exact_within_the_node_compressed_between(per_node, name):
    comm = Communicator(ranks_per_node=per_node)
    try:
        rng = np.random.default_rng(comm.rank)
        grad = rng.integers(-8, 9, 1000).astype(np.float32)     # node sums exact in any order
        got = NodeCompressedAllreduce(make_compressor(name), comm).allreduce_async(
            grad.copy(), op="sum").wait()
        node_sum = np.empty_like(grad)
        comm.node_comm.comm.Allreduce(grad, node_sum, op=MPI.SUM)
        want = node_sum
        if comm.node_comm.rank == 0:
            want = CompressedAllreduce(make_compressor(name), comm.inter_comm).allreduce_async(
                node_sum, op="sum").wait()
        comm.node_comm.comm.Bcast(want, root=0)
        assert np.array_equal(got, want)
        every = comm.comm.allgather(got.tobytes())
        assert all(b == every[0] for b in every)
        if name == "fp16":                   # small integers: fp16 is exact, so the sum is
            total = np.empty_like(grad)
            comm.comm.Allreduce(grad, total, op=MPI.SUM)
            assert np.array_equal(got, total)
        assert spans_nodes(comm) == (comm.num_nodes > 1 and comm.local_size > 1
                                     and comm.uniform_nodes)
    finally:
        comm.free()
