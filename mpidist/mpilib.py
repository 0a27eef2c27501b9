"""Which MPI library this process runs in: its family, version, ABI and file.

Everything MPI-specific in mpidist (Open MPI's MCA settings, its osc components, the
single-copy probe, how ULFM is switched on) asks here first, so that it acts only inside
the library it was written for and does nothing wrong elsewhere. The answers come from the
library mpi4py loaded (MPI_Get_library_version, and the file that holds the MPI_Init mpi4py
calls, found through the dynamic linker from mpi4py's own module), never from a name scan.
"""
from __future__ import annotations

import ctypes
import functools
import os

from mpi4py import MPI

__all__ = ["family", "version", "abi", "path", "describe", "ulfm_switched_on"]

# families by what their MPI_Get_library_version says, most specific first
_FAMILIES = (("Open MPI", "openmpi"), ("Intel(R) MPI", "intel"), ("MVAPICH", "mvapich"),
             ("CRAY MPICH", "cray"), ("MPICH", "mpich"))


@functools.lru_cache(maxsize=None)
def version() -> str:
    """The library's own one-line version string."""
    text = MPI.Get_library_version().replace("\x00", "").strip()
    return text.splitlines()[0].strip() if text else "unknown MPI"


@functools.lru_cache(maxsize=None)
def family() -> str:
    """'openmpi', 'mpich', 'intel', 'mvapich', 'cray' or 'other' (the MPICH derivatives keep
    their own names; `in_mpich_family()` groups them)."""
    text = MPI.Get_library_version()
    for mark, name in _FAMILIES:
        if mark.lower() in text.lower():
            return name
    return "other"


def in_mpich_family() -> bool:
    return family() in ("mpich", "intel", "mvapich", "cray")


@functools.lru_cache(maxsize=None)
def abi() -> str:
    """How mpi4py binds to the library: the ABI its module was built for ('mpich' or
    'openmpi' for the mpi4py wheel's per-family modules, 'MPI-5 standard' for the standard
    ABI) or 'native' (mpi4py built against this very library)."""
    parts = os.path.basename(MPI.__file__).split(".")
    tag = parts[1] if len(parts) > 2 and not parts[1].startswith(("cpython", "pypy", "abi3")) \
        else ""
    if not tag:
        return "native"
    return "MPI-5 standard" if tag in ("mpiabi", "abi") else tag


class _DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]


@functools.lru_cache(maxsize=None)
def path() -> str:
    """The file of the MPI_Init that mpi4py calls ('' where the linker can not say):
    looked up through mpi4py's module, so it is the library mpi4py uses, shim or not."""
    try:
        fn = getattr(ctypes.CDLL(MPI.__file__), "MPI_Init")
        libc = ctypes.CDLL(None)
        info = _DlInfo()
        if not libc.dladdr(ctypes.c_void_p(ctypes.cast(fn, ctypes.c_void_p).value),
                           ctypes.byref(info)) or not info.fname:
            return ""
        return os.path.realpath(info.fname.decode())
    except (OSError, AttributeError):
        return ""


def describe() -> str:
    """One line: version, ABI and file."""
    where = path()
    return f"{version()} (ABI: {abi()}" + (f"; {where})" if where else ")")


def ulfm_switched_on(env: dict | None = None) -> bool:
    """Whether the launcher switched this library's fault tolerance (ULFM) on: Open MPI's
    `mpiexec --with-ft ulfm` sets OMPI_MCA_mpi_ft_enable, MPICH's is MPIR_CVAR_ENABLE_FT.
    The API itself (Comm.Shrink, the failure error classes) is checked by the caller."""
    env = os.environ if env is None else env
    var = {"openmpi": "OMPI_MCA_mpi_ft_enable"}.get(family(), "MPIR_CVAR_ENABLE_FT" if
                                                    in_mpich_family() else None)
    return var is not None and env.get(var, "").strip().lower() in ("1", "true", "yes", "on")
