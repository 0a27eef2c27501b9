"""Settings the MPI library reads once, at MPI_Init, chosen before mpi4py starts it.

Open MPI 5 tries its UCX one-sided component (osc/ucx) for every window, and where UCX finds
no RDMA device it prints an error line per rank and window, then falls back to another
component anyway. On a host with no RDMA device (/sys/class/infiniband empty or absent)
mpidist leaves that component out, unless OMPI_MCA_osc is set already; on an InfiniBand or
RoCE host it stays, since there it is the fast one. MPI libraries other than Open MPI ignore
the variable.

Open MPI's TCP transport sends a message above its eager limit (64 KiB) by rendezvous: the
receiver answers before the data moves. Across a loaded link that answer queues behind the
data flowing the other way, once per ring segment, so mpidist raises the limit to hold one
segment (`segment_bytes`, plus room for the header) and the ring's segments go eagerly into
receives it posted ahead; unless OMPI_MCA_btl_tcp_eager_limit is set already, or a segment is
above EAGER_MOST (the transport's eager fragments are buffers of the limit's size, a pool of
them for the process: segments that large stay with rendezvous). UCX (MPICH's transport
between nodes, and Open MPI's where it picks UCX) answers its rendezvous the same way, so on
a host with no RDMA device, where its traffic between nodes is TCP, its threshold
(UCX_RNDV_THRESH) is raised to one segment too, unless set already.

Both take effect only where `import mpidist` comes before MPI is initialised (mpi4py
initialises it on `from mpi4py import MPI`).
"""
from __future__ import annotations

import functools
import os

__all__ = ["apply", "segment_bytes", "EAGER_MOST"]

_RDMA = "/sys/class/infiniband"
_EAGER = "OMPI_MCA_btl_tcp_eager_limit"
_UCX_RNDV = "UCX_RNDV_THRESH"
_HEADER = 1024                     # room for the MPI library's header beside one segment
_TCP_EAGER_DEFAULT = 64 << 10      # Open MPI's own btl_tcp_eager_limit
EAGER_MOST = 4 << 20               # the largest segment the limit is raised for


def segment_bytes(env=None) -> int:
    """Bytes per pipelined segment of the ring and the tree (env MPIDIST_SEGMENT_BYTES,
    default 1 MiB); a bad value raises ValueError naming the variable.

    Without a single-copy transport or an MPI progress thread, a segment moves only while
    both neighbours are inside MPI calls, so segments stay large enough for the per-message
    cost to be small against the copy and the reduction.
    """
    return _parse_segment_bytes((os.environ if env is None else env).get("MPIDIST_SEGMENT_BYTES"))


@functools.lru_cache(maxsize=8)
def _parse_segment_bytes(value: str | None) -> int:
    if not value:
        return 1 << 20
    try:
        seg = int(value)
    except ValueError:
        seg = 0
    if seg < 1:
        raise ValueError(f"MPIDIST_SEGMENT_BYTES must be a positive number of bytes, got {value!r}")
    return seg


def apply(env=None) -> dict:
    """Set the defaults in env (default os.environ); returns what was set."""
    env = os.environ if env is None else env
    done = {}
    try:
        rdma = bool(os.listdir(_RDMA))
    except OSError:
        rdma = False
    if not rdma and "OMPI_MCA_osc" not in env:
        env["OMPI_MCA_osc"] = done["OMPI_MCA_osc"] = "^ucx"
    try:
        seg = segment_bytes(env)
    except ValueError:
        seg = 0                    # the ring raises, on every rank, when it runs
    if _TCP_EAGER_DEFAULT < seg + _HEADER and seg <= EAGER_MOST:
        for var, where in ((_EAGER, True), (_UCX_RNDV, not rdma)):
            if where and var not in env:
                env[var] = done[var] = str(seg + _HEADER)
    return done
