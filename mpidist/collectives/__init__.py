"""mpidist collectives: allreduce algorithms (ring, tree, double binary tree, hierarchical,
recursive doubling, Rabenseifner, native MPI), reduce-scatter/allgather building blocks,
tensor fusion with async handles, and cost-model based auto-selection."""
from mpidist.collectives.core import allgather, allreduce, reduce_scatter
from mpidist.collectives.fusion import Handle, allreduce_async
from mpidist.collectives.ops import OPS
from mpidist.collectives.registry import ALGORITHMS

__all__ = ["allreduce", "allreduce_async", "Handle", "reduce_scatter", "allgather", "ALGORITHMS",
           "OPS"]
