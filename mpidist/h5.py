"""How mpidist opens HDF5 files on a communicator: parallel HDF5 (h5py's mpio driver)
where h5py was built with MPI, else each rank on its own with the default driver.

Reads need no coordination either way. Writes (checkpoints) with MPI-IO go to the file
from every rank at once; without it, ranks take turns (checkpoint.writer).
"""
from __future__ import annotations

import os

import h5py

from mpidist.errors import agree_or_raise

__all__ = ["parallel_hdf5", "agreed_parallel_hdf5", "open_file", "ENV_MPIO"]

ENV_MPIO = "MPIDIST_HDF5_MPIO"


def parallel_hdf5() -> bool:
    """h5py was built with MPI (`mpidist info` shows it as MPI-IO), and MPIDIST_HDF5_MPIO=0
    does not turn it off (for a filesystem whose MPI-IO is broken or slow, such as NFS
    without the locking ROMIO needs)."""
    env = os.environ.get(ENV_MPIO, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{ENV_MPIO} must be 0 or 1, got {env!r}")
    return env != "0" and bool(h5py.get_config().mpi)


def agreed_parallel_hdf5(comm) -> bool:
    """Collective: parallel_hdf5() on every rank of comm (a Communicator), so that all take
    the same path; a bad MPIDIST_HDF5_MPIO on any rank raises ValueError on all."""
    mine, err = False, None
    try:
        mine = parallel_hdf5()
    except ValueError as exc:
        err = exc
    agree_or_raise(comm, err, ValueError)
    return comm.all(mine)


def open_file(path: str, mode: str, comm=None, **kwargs):
    """h5py.File(path, mode): with the mpio driver over comm (collective) when comm has
    several ranks and every rank's h5py has MPI, else plainly on this rank."""
    if comm is None or comm.size == 1 or not agreed_parallel_hdf5(comm):
        return h5py.File(path, mode, **kwargs)
    return h5py.File(path, mode, driver="mpio", comm=comm.comm, **kwargs)
