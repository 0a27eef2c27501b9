"""mpidist.torch on nodes of several ranks (MPIDIST_RANKS_PER_NODE splits of this job): the
path through the node and across the nodes equals one process on the global batch."""
import pytest

pytest.importorskip("torch", reason="needs PyTorch (the torch extra)")

from mpidist.comm import Communicator  # noqa: E402

from .hierarchy_case import max_rel_diff  # noqa: E402


@pytest.mark.parametrize("per_node", [1, 2, 3])
@pytest.mark.parametrize("algorithm", ["auto", "hierarchical", "ring"])
def test_node_splits_equal_one_process(per_node, algorithm):
    comm = Communicator(ranks_per_node=per_node)
    try:
        assert max_rel_diff(comm, algorithm) <= 1e-5
    finally:
        comm.free()


@pytest.mark.parametrize("per_node", [1, 2])
def test_compressed_between_nodes_stays_near_one_process(per_node):
    """fp16 on the hop between nodes (exact within them): close to one process, not equal."""
    comm = Communicator(ranks_per_node=per_node)
    try:
        assert max_rel_diff(comm, compression="fp16") <= 1e-3
    finally:
        comm.free()
