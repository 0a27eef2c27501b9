"""Compression on the inter-node hop only, for ranks grouped in nodes:
1. the exact sum of the bucket within the node (mpidist.collectives, shared memory);
2. the node leaders' compressed allreduce of those sums (CompressedAllreduce over one
   rank per node, with the leader's own error feedback);
3. the leader's result broadcast within the node.
Only compressed payloads cross the slow links, and nothing within a node is approximated:
the sum a node contributes is the sum one rank on the node's whole batch would compute.
A node's ranks all end with the leader's bits, so every rank holds the same result.
"""
from __future__ import annotations

import copy

from mpidist.collectives import allreduce
from mpidist.collectives.handle import Handle
from mpidist.compress.allreduce import CompressedAllreduce

__all__ = ["NodeCompressedAllreduce", "spans_nodes"]


def spans_nodes(comm) -> bool:
    """Whether comm has several nodes of several ranks each, all of one size (where an
    exact step within the node and a compressed one across them differ from compressing
    everything)."""
    return comm.num_nodes > 1 and comm.local_size > 1 and comm.uniform_nodes


class NodeCompressedAllreduce:
    """The CompressedAllreduce interface (allreduce_async(buf, op, layout) -> Handle of the
    result, total_bytes_sent) with compression between the nodes only.

    compressor: a Compressor; the leaders each use a copy. Options as CompressedAllreduce's
    (warmup_steps, nonfinite, algorithm), applied between the leaders. Collective over comm.
    """

    def __init__(self, compressor, comm, **options):
        self.comm = comm
        self.node = comm.node_comm
        self.leader = self.node.rank == 0
        # only the leaders talk across nodes: inter_comm of local rank 0 is one rank per node
        self.between = CompressedAllreduce(copy.deepcopy(compressor), comm.inter_comm,
                                           **options) if self.leader else None

    @property
    def total_bytes_sent(self) -> int:
        """Bytes this rank sent across nodes (0 on a node's other ranks)."""
        return self.between.total_bytes_sent if self.leader else 0

    def allreduce_async(self, buf, *, op: str = "sum", layout=None,
                        inplace: bool = False) -> Handle:
        """The sum (or average) of buf over every rank, compressed between nodes; runs now,
        wait() returns the result (buf itself with inplace or on a node's other ranks, else
        a new array on the leaders)."""
        if op not in ("sum", "avg"):
            raise ValueError(f"compressed allreduce supports op 'sum' or 'avg', got {op!r}")
        # 1. the exact sum within the node
        allreduce(buf, op="sum", comm=self.node)
        # 2. the leaders' compressed allreduce across nodes
        out = self.between.allreduce_async(buf, op="sum", layout=layout,
                                           inplace=inplace).wait() if self.leader else buf
        # 3. the leader's result to the node's ranks
        self.node.comm.Bcast(out, root=0)
        if op == "avg":
            out /= self.comm.size
        return Handle(out)
