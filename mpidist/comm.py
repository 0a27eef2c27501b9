"""The communicator: a private duplicate of the user's MPI communicator and the one place
that knows the topology (nodes, local ranks, inter-node groups, real or simulated) and the
pipeline x data-parallel grid. Sub-communicators are built once and cached.

Never talks on the user's communicator itself: construction takes a `Dup()`, so mpidist's
messages can not match the application's (an HPC code passes its own communicator in).
"""
from __future__ import annotations

import functools
import os
import subprocess
import threading
from dataclasses import dataclass

from mpi4py import MPI

from mpidist import mpilib, threads
from mpidist.checks import positive_int
from mpidist.errors import MismatchError, agree_or_raise, format_ranks
from mpidist.kernels.backend import cupy, is_cupy, synchronize

__all__ = ["Communicator", "Grid", "default_communicator", "as_communicator", "on_free",
           "ENV_RANKS_PER_NODE", "ENV_CUDA_AWARE"]

ENV_RANKS_PER_NODE = "MPIDIST_RANKS_PER_NODE"
ENV_CUDA_AWARE = "MPIDIST_CUDA_AWARE"

_free_hooks: list = []


def on_free(hook) -> None:
    """Register hook(communicator), which Communicator.free() calls on every rank before
    the MPI communicator goes: modules that cache resources per communicator (shared
    windows, worker threads, scratch memory) let them go with it, not at MPI_Finalize."""
    _free_hooks.append(hook)


@dataclass(frozen=True)
class Grid:
    """Ranks as pipeline stages x data-parallel replicas: rank = stage * dp + replica.

    Data-parallel groups are runs of consecutive ranks, so with block placement they share
    a node and the heavy gradient allreduce stays intra-node; pipeline neighbours exchange
    only activations.
    """
    pp: int
    dp: int
    stage: int
    replica: int
    pp_comm: "Communicator"   # my replica's stages, ordered by stage
    dp_comm: "Communicator"   # my stage's replicas, ordered by replica

    def rank_of(self, stage: int, replica: int) -> int:
        return stage * self.dp + replica


class Communicator:
    """A private communicator with its topology.

    comm: an mpi4py communicator (default COMM_WORLD); mpidist works on its Dup().
    ranks_per_node: simulate nodes of this many consecutive ranks (the last node may be
      smaller); default: env MPIDIST_RANKS_PER_NODE, else the real shared-memory split.
    Construction is collective over `comm`.
    """

    # the flight recorder's record of the calls made on this communicator (collectives.flight)
    flight_record = None
    # the mismatch guard's ballot record on this communicator (collectives.ballot)
    ballot = None
    # auto's plan for this communicator: its layout's row of the decision table (collectives.select)
    auto_plan = None

    def __init__(self, comm: MPI.Comm | None = None, *, ranks_per_node: int | None = None,
                 _node: int | None = None, _dup: bool = True):
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py MPI.Comm or None, got {type(comm).__name__}")
        if comm == MPI.COMM_NULL:
            raise ValueError("comm is MPI.COMM_NULL: this rank is not part of the communicator")
        self.comm: MPI.Comm = comm.Dup() if _dup else comm
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self._subcomms: dict = {}
        self._grids: dict = {}
        self._freed = False

        if ranks_per_node is None and _node is None and os.environ.get(ENV_RANKS_PER_NODE):
            ranks_per_node = os.environ[ENV_RANKS_PER_NODE]
        if ranks_per_node is not None:
            ranks_per_node = positive_int("ranks_per_node", ranks_per_node)
        self.simulated_nodes = ranks_per_node is not None

        # 1. which node am I on: simulated, inherited from a parent, or the shared-memory split;
        #    a world-sized communicator also counts the host's ranks that share my cores
        world = self.size == MPI.COMM_WORLD.Get_size()
        host = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank) \
            if world or (ranks_per_node is None and _node is None) else None
        if ranks_per_node is not None:
            node = self.rank // ranks_per_node
        elif _node is not None:
            node = _node
        else:
            leader = self.comm.allgather(host.allreduce(self.rank, op=MPI.MIN))
            node = sorted(set(leader)).index(leader[self.rank])
        sharing = threads.sharers(threads.affinity(), host.allgather(threads.affinity())) \
            if world else 0
        if host is not None:
            host.Free()
        # 2. node numbers made dense in order of their lowest rank; sizes of all nodes
        nodes = self.comm.allgather(node)
        order = sorted(set(nodes), key=nodes.index)
        self._node_of_rank = [order.index(n) for n in nodes]
        self.node: int = self._node_of_rank[self.rank]
        self.num_nodes: int = len(order)
        self.node_sizes: list[int] = [self._node_of_rank.count(i) for i in range(self.num_nodes)]
        self.uniform_nodes: bool = len(set(self.node_sizes)) == 1
        # 3. intra-node and inter-node communicators, built once
        node_mpi = self.comm.Split(color=self.node, key=self.rank)
        self.local_rank: int = node_mpi.Get_rank()
        self.local_size: int = node_mpi.Get_size()
        inter_mpi = self.comm.Split(color=self.local_rank, key=self.rank)
        self.node_comm = Communicator._leaf(node_mpi, one_per_node=False)
        self.inter_comm = Communicator._leaf(inter_mpi, one_per_node=True)
        if world:
            # 4. threads per rank: this rank's cores shared among the ranks that may run on
            #    them (mpidist.threads)
            threads.configure(sharing)

    @classmethod
    def _leaf(cls, mpi_comm: MPI.Comm, *, one_per_node: bool) -> "Communicator":
        """The node or inter-node communicator: its topology is known, not re-detected.

        A node communicator is one node; an inter-node communicator has one rank per node.
        Its own node/inter communicators are itself or a one-rank communicator.
        """
        obj = cls.__new__(cls)
        obj.comm = mpi_comm
        obj.rank, obj.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        obj._subcomms, obj._grids, obj._freed = {}, {}, False
        obj.simulated_nodes = False
        obj._node_of_rank = list(range(obj.size)) if one_per_node else [0] * obj.size
        obj.node = obj._node_of_rank[obj.rank]
        obj.num_nodes = len(set(obj._node_of_rank))
        obj.node_sizes = [obj._node_of_rank.count(i) for i in range(obj.num_nodes)]
        obj.uniform_nodes = True
        one_node = obj.num_nodes == 1
        obj.local_rank, obj.local_size = (obj.rank, obj.size) if one_node else (0, 1)
        if obj.size == 1:
            obj.node_comm = obj.inter_comm = obj
        elif one_node:
            obj.node_comm, obj.inter_comm = obj, cls._leaf(MPI.COMM_SELF.Dup(), one_per_node=True)
        else:
            obj.node_comm, obj.inter_comm = cls._leaf(MPI.COMM_SELF.Dup(), one_per_node=False), obj
        return obj

    # ---------------------------------------------------------------- sub-communicators
    def split(self, color: int, key: int | None = None) -> "Communicator":
        """Collective: ranks with equal color form a Communicator (cached by color, key).

        Members keep the node they are on, so hierarchical algorithms work inside it.
        """
        mine = (int(color), self.rank if key is None else int(key))
        # the cache key is the whole grouping, agreed by all ranks, so every rank hits or
        # misses together (a per-rank key would let some ranks skip the collective Split)
        grouping = tuple(self.comm.allgather(mine))
        sub = self._subcomms.get(grouping)
        if sub is None:
            mpi = self.comm.Split(color=mine[0], key=mine[1])
            sub = Communicator(mpi, _node=self.node, _dup=False)
            self._subcomms[grouping] = sub
        return sub

    def grid(self, pp: int) -> Grid:
        """Collective: the pp x dp grid (rank = stage * dp + replica), cached per pp."""
        pp = positive_int("pipeline stages (pp)", pp)
        if self.size % pp:
            raise ValueError(f"{pp} pipeline stages do not divide the world size {self.size}; "
                             f"use a divisor of {self.size}")
        grid = self._grids.get(pp)
        if grid is None:
            dp = self.size // pp
            stage, replica = divmod(self.rank, dp)
            dp_comm = self.split(color=stage, key=replica)
            pp_comm = self.split(color=self.size + replica, key=stage)
            grid = Grid(pp, dp, stage, replica, pp_comm, dp_comm)
            self._grids[pp] = grid
        return grid

    # ---------------------------------------------------------------- device buffers
    @property
    def cuda_aware(self) -> bool:
        """True when the MPI library takes CUDA device pointers (env overrides)."""
        return cuda_aware_mpi()

    def use_gpu(self) -> int:
        """Make this rank's GPU CuPy's current device and return its id: the node's GPUs
        round-robin by local rank (as Horovod and DDP pin one GPU per local rank), among
        those CUDA_VISIBLE_DEVICES shows."""
        cp = cupy()
        device = self.local_rank % cp.cuda.runtime.getDeviceCount()
        cp.cuda.Device(device).use()
        return device

    def to_mpi(self, x):
        """A buffer MPI may touch for array x (synchronised device data or a host copy)."""
        if not is_cupy(x):
            return x
        synchronize(x)
        return x if self.cuda_aware else x.get()

    def from_mpi(self, buf, x) -> None:
        """Copy a staged host buffer back into device array x (no-op when not staged)."""
        if buf is not x and is_cupy(x):
            x.set(buf)

    # ---------------------------------------------------------------- agreement
    def any(self, flag: bool) -> bool:
        return bool(self.comm.allreduce(bool(flag), op=MPI.LOR))

    def all(self, flag: bool) -> bool:
        return bool(self.comm.allreduce(bool(flag), op=MPI.LAND))

    def check_same(self, value, what: str, hint: str = "") -> None:
        """Collective: raise MismatchError on every rank unless all ranks pass equal values
        (the message names the groups of ranks and their values, then the hint)."""
        values = self.comm.allgather(value)
        groups: dict = {}
        for r, v in enumerate(values):
            groups.setdefault(repr(v), []).append(r)
        if len(groups) > 1:
            detail = "; ".join(f"ranks {format_ranks(rs)}: {v}" for v, rs in groups.items())
            raise MismatchError(f"{what} differs across ranks ({detail})" + (f"; {hint}" if hint else ""))

    def raise_if_any(self, exc: BaseException | None) -> None:
        """Collective: errors.agree_or_raise on this communicator (the failing ranks raise
        their own exception, the others RemoteError naming them and their messages)."""
        agree_or_raise(self, exc)

    # ---------------------------------------------------------------- lifecycle
    def communicators(self) -> list:
        """Every MPI communicator this one holds, each once: its own, its cached
        sub-communicators' and the node / inter-node ones (what fault tolerance revokes
        when a rank dies, so that no survivor stays blocked on any of them)."""
        found, todo, seen = [], [self], set()
        while todo:
            c = todo.pop()
            if id(c) in seen:
                continue
            seen.add(id(c))
            found.append(c.comm)
            todo += list(c._subcomms.values())
            todo += [k for k in (getattr(c, "node_comm", None), getattr(c, "inter_comm", None)) if k is not None]
        return found

    def free(self) -> None:
        """Free the private communicator, every cached sub-communicator and what the
        collectives hold for them (collective)."""
        if self._freed:
            return
        self._freed = True
        for hook in _free_hooks:
            hook(self)
        for sub in self._subcomms.values():
            sub.free()
        for child in (getattr(self, "node_comm", None), getattr(self, "inter_comm", None)):
            if child is not None and child is not self:
                child.free()
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            self.comm.Free()

    def describe(self) -> str:
        kind = "simulated" if self.simulated_nodes else "detected"
        return (f"{self.size} ranks on {self.num_nodes} node(s) ({kind}), "
                f"ranks per node {self.node_sizes}")

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, size={self.size}, node={self.node}/"
                f"{self.num_nodes}, local_rank={self.local_rank}/{self.local_size})")


_default: Communicator | None = None
_default_lock = threading.Lock()
_wrapped: dict[int, Communicator] = {}


def default_communicator() -> Communicator:
    """The process-wide private Dup of COMM_WORLD, created on first use (collective then)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Communicator()
        return _default


def as_communicator(comm) -> Communicator:
    """None -> default_communicator(); Communicator -> itself; mpi4py Comm -> wrapped once."""
    if comm is None:
        return default_communicator()
    if isinstance(comm, Communicator):
        return comm
    if isinstance(comm, MPI.Comm):
        key = MPI._handleof(comm)
        if key not in _wrapped:
            _wrapped[key] = Communicator(comm)
        return _wrapped[key]
    raise TypeError(f"comm must be a mpidist Communicator, an mpi4py Comm or None, "
                    f"got {type(comm).__name__}")


def cuda_aware_mpi() -> bool:
    """Does the MPI library accept device pointers? Env MPIDIST_CUDA_AWARE=0/1 decides first;
    then the library's own answer (MPIX_Query_cuda_support via mpi4py) where it gives one."""
    env = os.environ.get(ENV_CUDA_AWARE)
    if env is not None and env.strip() != "":
        if env.strip() not in ("0", "1"):
            raise ValueError(f"{ENV_CUDA_AWARE} must be 0 or 1, got {env!r}")
        return env.strip() == "1"
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:
            return False
    return _ompi_built_with_cuda()


@functools.lru_cache(maxsize=None)
def _ompi_built_with_cuda() -> bool:
    """Open MPI says whether it was built with CUDA support through ompi_info."""
    if mpilib.family() != "openmpi":
        return False
    try:
        out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "mpi_built_with_cuda_support:value:true" in out


def mpi_library() -> str:
    """The MPI library's own one-line version string (mpilib.version)."""
    return mpilib.version()
