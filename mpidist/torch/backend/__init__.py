"""The "mpidist" torch.distributed backend: DDP, FSDP2, DeviceMesh and
torch.distributed.checkpoint run on mpidist's collectives over an mpi4py communicator, on a
stock torch (whose wheels have no MPI backend), with no MASTER_ADDR/PORT to set.

    from mpidist.torch.backend import init_process_group
    init_process_group()              # was: torch.distributed.init_process_group("gloo")
    model = DistributedDataParallel(model)

Under mpiexec/srun, ranks and world size come from MPI. The process group works on a private
duplicate of `comm` (default COMM_WORLD), so a host code's own messages stay apart;
`new_group` and DeviceMesh dimensions become MPI sub-communicators of it. Allreduces use
mpidist's algorithm choice ("auto", or one named per process group). CPU tensors, and CUDA
tensors ordered after torch's current stream (cuda.py).

The backend is plain Python: a torch.distributed.ProcessGroup subclass (process_group.py)
registered for "cpu" and "cuda", which torch's C++ callers (DDP's reducer, DTensor's
functional collectives) reach through torch's own ProcessGroup trampoline; nothing is
compiled. Importing this module (or mpidist.torch) registers "mpidist"; under an MPI
launcher it also fills torch's rendezvous variables (register), so a plain
`torch.distributed.init_process_group("mpidist")` works.
"""
from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

import torch.distributed as dist
from mpi4py import MPI

from mpidist.collectives.registry import algorithm_names
from mpidist.comm import Communicator
from mpidist.torch.backend.group import Group
from mpidist.torch.backend.process_group import NAME, ProcessGroup

__all__ = ["NAME", "register", "init_process_group", "Group", "ProcessGroup"]

_MARK = "MPIDIST_TORCH_RENDEZVOUS"     # "<pid>": the process that filled the variables
_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_lock = threading.Lock()
_state = {"registered": False, "comm": None, "algorithm": "auto", "world": None}


def register(*, rendezvous_env: bool = True) -> None:
    """Register the "mpidist" backend with torch.distributed (idempotent).

    rendezvous_env: also fill RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from
    MPI where they are unset (collective over COMM_WORLD: rank 0 picks a free port), so a
    plain `torch.distributed.init_process_group("mpidist")` works under mpiexec.
    """
    with _lock:
        if not _state["registered"]:
            dist.Backend.register_backend(NAME, _create, extended_api=True,
                                          devices=["cpu", "cuda"])
            _state["registered"] = True
    if rendezvous_env:
        _fill_env()


def _fill_env() -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from MPI where unset
    (collective over COMM_WORLD). Values a parent process filled (a job started from inside a
    rank inherits them) are replaced: they describe the parent's job."""
    mark = os.environ.get(_MARK)
    if mark is not None and mark != str(os.getpid()):
        for key in _KEYS:
            os.environ.pop(key, None)
    for key, value in _rendezvous(MPI.COMM_WORLD).items():
        os.environ.setdefault(key, str(value))
    os.environ[_MARK] = str(os.getpid())


def _launched() -> bool:
    """Whether this process is a rank started by an MPI launcher (mpiexec, srun)."""
    return any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def init_process_group(comm: MPI.Comm | None = None, *, algorithm: str = "auto",
                       timeout: timedelta | None = None, **kwargs) -> None:
    """torch.distributed.init_process_group over "mpidist" on (a duplicate of) `comm`.

    comm: an mpi4py communicator (default COMM_WORLD); torch's rank and world size are its
    own. algorithm: mpidist's allreduce algorithm for every process group created later
    (`new_group(..., pg_options={"algorithm": name})` picks one per group). Other keyword
    arguments go to torch.distributed.init_process_group. Collective over comm.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
        raise TypeError(f"comm must be an mpi4py communicator (not COMM_NULL), got {comm!r}")
    _check_algorithm(algorithm)
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; call "
                           "torch.distributed.destroy_process_group() first")
    register(rendezvous_env=False)
    r = _rendezvous(comm)
    store = dist.TCPStore(r["MASTER_ADDR"], int(r["MASTER_PORT"]), comm.Get_size(),
                          is_master=comm.Get_rank() == 0, wait_for_workers=False,
                          **({} if timeout is None else {"timeout": timeout}))
    _state.update(comm=comm, algorithm=algorithm)
    dist.init_process_group(NAME, store=store, rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=timeout, **kwargs)


def _rendezvous(comm: MPI.Comm) -> dict:
    """Rank, size, local rank and rank 0's address with a free port, agreed over a
    duplicate of comm (collective)."""
    c = comm.Dup()
    try:
        host = socket.gethostname()
        hosts = c.allgather(host)
        port = None
        if c.Get_rank() == 0:
            with socket.socket() as s:           # a free port: bind 0, read it, release
                s.bind(("", 0))
                port = s.getsockname()[1]
        port = c.bcast(port, root=0)
        local = c.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank = local.Get_rank()
        local.Free()
        # rank 0's MASTER_ADDR where it has one (the interface its site or launcher names),
        # else loopback on one host, else rank 0's host name
        addr = c.bcast(os.environ.get("MASTER_ADDR") if c.Get_rank() == 0 else None, root=0)
        if not addr:
            addr = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
        return {"RANK": c.Get_rank(), "WORLD_SIZE": c.Get_size(), "LOCAL_RANK": local_rank,
                "MASTER_ADDR": addr, "MASTER_PORT": port}
    finally:
        c.Free()


def _check_algorithm(name) -> str:
    if name not in algorithm_names():
        raise ValueError(f"unknown allreduce algorithm {name!r}; valid: "
                         f"{', '.join(algorithm_names())}")
    return name


def _algorithm(options) -> str:
    """The algorithm of a new group: pg_options={"algorithm": name}, else the default."""
    if options is None:
        return _state["algorithm"]
    if not isinstance(options, dict) or set(options) - {"algorithm"}:
        raise ValueError(f"the mpidist backend's pg_options is a dict with the key "
                         f"'algorithm', got {options!r}")
    return _check_algorithm(options.get("algorithm", _state["algorithm"]))


def _create(opts, pg_options):
    """torch's factory (extended API): the ProcessGroup of a new process group.

    The default group duplicates the chosen communicator; a subgroup (new_group, a DeviceMesh
    dimension) is created from it by its members alone (MPI_Comm_create_group), as torch
    calls this only on the members.
    """
    ranks = list(opts.global_ranks_in_group)
    if not ranks or _state["world"] is None:
        base = _state["comm"] or MPI.COMM_WORLD
        _state["comm"] = None                     # used once: a later default is COMM_WORLD
        comm = Communicator(base)
        if _state["world"] is not None:           # the previous default group's
            _state["world"].Free()
        _state["world"] = comm.comm.Dup()         # subgroups are cut from this one
    else:
        world = _state["world"]
        sub = world.Create_group(world.Get_group().Incl(ranks))
        comm = Communicator(sub)
        sub.Free()
    error = None
    try:
        if (opts.group_rank, opts.group_size) != (comm.rank, comm.size):
            raise RuntimeError(
                f"torch gave this process rank {opts.group_rank} of {opts.group_size} but MPI "
                f"says {comm.rank} of {comm.size}; unset RANK/WORLD_SIZE or use "
                f"mpidist.torch.backend.init_process_group()")
        algorithm = _algorithm(pg_options)
    except (RuntimeError, ValueError) as exc:
        error = exc
    comm.raise_if_any(error)
    return ProcessGroup(Group(comm, algorithm))


register(rendezvous_env=_launched())
