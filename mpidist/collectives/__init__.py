"""mpidist collectives: allreduce algorithms (ring, tree, double binary tree, hierarchical,
recursive doubling, Rabenseifner, shared memory, native MPI), reduce-scatter/allgather
building blocks, tensor fusion with async handles, and cost-model based auto-selection.

    from mpidist.collectives import allreduce, allreduce_async, reduce_scatter, allgather
    allreduce(grad, op="avg")                      # in place; returns grad
    y = allreduce(x, algorithm="ring", out=np.empty_like(x))
    h = allreduce_async(bucket, op="avg"); ...; h.wait()
    h = allreduce_async([g1, g2, g3], bucket_bytes=1 << 20)    # fused into buckets
    shard = reduce_scatter(flat)                   # chunk(len(flat), rank, size) of the sum
    full = allgather(shard)                        # or allgather(shard, out=flat)

comm: a mpidist Communicator, an mpi4py communicator, or None (a private duplicate of
COMM_WORLD). Every rank must make the same calls in the same order; the mismatch guard
(guard.py) turns a disagreement into an error on every rank. Every rank ends with the same
bits. float16/bfloat16 are reduced in float32. Each algorithm module documents its cost.
"""
from mpidist.collectives.core import allgather, allreduce, reduce_scatter
from mpidist.collectives.fusion import allreduce_async
from mpidist.collectives.handle import Handle
from mpidist.collectives.ops import OPS
from mpidist.collectives.registry import ALGORITHMS

__all__ = ["allreduce", "allreduce_async", "Handle", "reduce_scatter", "allgather", "ALGORITHMS",
           "OPS"]
