"""The MPI library's own MPI_Allreduce: the baseline, and a candidate for "auto" (it often
wins for small messages, where one C call beats Python-level steps)."""
from __future__ import annotations

from mpi4py import MPI

from mpidist.collectives.ops import Op
from mpidist.collectives.workspace import same_view
from mpidist.partition import counts_displs

__all__ = ["allreduce", "reduce_scatter", "allgather"]


def allreduce(comm, sendbuf, recvbuf, op: Op):
    """MPI_Allreduce (in place when recvbuf is sendbuf); avg divides afterwards."""
    comm.comm.Allreduce(MPI.IN_PLACE if same_view(sendbuf, recvbuf) else sendbuf, recvbuf,
                        op.mpi_op)
    op.finalize(recvbuf, comm.size)
    return recvbuf


def reduce_scatter(comm, sendbuf, shard, op: Op, *, finalize_n: int | None = None):
    """MPI_Reduce_scatter with the chunk() counts."""
    counts, _ = counts_displs(len(sendbuf), comm.size)
    comm.comm.Reduce_scatter(sendbuf, shard, counts, op.mpi_op)
    if finalize_n is not None:
        op.finalize(shard, finalize_n)
    return shard


def allgather(comm, shard, out):
    """MPI_Allgatherv with the chunk() counts and displacements."""
    counts, displs = counts_displs(len(out), comm.size)
    mine = out[displs[comm.rank]:displs[comm.rank] + counts[comm.rank]]
    send = MPI.IN_PLACE if same_view(shard, mine) else shard     # MPI forbids aliasing
    comm.comm.Allgatherv(send, [out, counts, displs, None])
    return out
