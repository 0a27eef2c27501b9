"""Hierarchical 2D-ring allreduce for ranks grouped in nodes:
1. intra-node ring reduce-scatter: local rank l holds the node's sum of shard l;
2. inter-node ring allreduce of shard l among the ranks with local rank l (one per node);
3. intra-node ring allgather of the shards.
Only n / ranks-per-node crosses the slow inter-node links per rank, instead of the flat
ring's full 2 (p-1)/p n.

Nodes come from the Communicator (shared-memory split, or simulated with
Communicator(ranks_per_node=k) / env MPIDIST_RANKS_PER_NODE). With nodes of unequal size
the shards would not line up across nodes, so it falls back to the flat ring.

Cost: intra ring reduce-scatter + allgather over L = ranks per node, inter ring allreduce
of n/L over N nodes, each with its own link level's alpha, beta, gamma.
"""
from __future__ import annotations

from mpidist.collectives import ring
from mpidist.collectives.ops import Op
from mpidist.partition import chunk

__all__ = ["allreduce"]


def allreduce(comm, sendbuf, recvbuf, op: Op):
    """Hierarchical allreduce (recvbuf may be sendbuf); flat ring on non-uniform nodes."""
    if not comm.uniform_nodes or comm.num_nodes == 1 or comm.local_size == 1:
        return ring.allreduce(comm, sendbuf, recvbuf, op)
    node, inter = comm.node_comm, comm.inter_comm
    offset, count = chunk(len(sendbuf), node.rank, node.size)
    shard = recvbuf[offset:offset + count]
    # 1. intra-node reduce-scatter
    ring.reduce_scatter(node, sendbuf, shard, op.base)
    # 2. inter-node allreduce of my shard among the ranks with my local rank
    ring.allreduce(inter, shard, shard, op.base)
    op.finalize(shard, comm.size)
    # 3. intra-node allgather
    return ring.allgather(node, shard, recvbuf)
