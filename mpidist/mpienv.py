"""Settings the MPI library reads once, at MPI_Init, chosen before mpi4py starts it.

Open MPI 5 tries its UCX one-sided component (osc/ucx) for every window, and where UCX finds
no RDMA device it prints an error line per rank and window, then falls back to another
component anyway. On a host with no RDMA device (/sys/class/infiniband empty or absent)
mpidist leaves that component out, unless OMPI_MCA_osc is set already; on an InfiniBand or
RoCE host it stays, since there it is the fast one. MPI libraries other than Open MPI ignore
the variable. It takes effect only where `import mpidist` comes before MPI is initialised
(mpi4py initialises it on `from mpi4py import MPI`).
"""
from __future__ import annotations

import os

__all__ = ["apply"]

_RDMA = "/sys/class/infiniband"


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
    return done
