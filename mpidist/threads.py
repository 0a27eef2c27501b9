"""Intra-op threads per rank: Numba's and torch's default to the cores this rank may use
(os.sched_getaffinity) shared among the ranks of its host that may run on them.

Left alone, every rank of a plain `mpiexec -n 2` starts one Numba thread and one torch
thread per core, and the node runs ranks x cores threads on its cores: the fused kernels
then wait on each other's threads. `python -m mpidist.launcher` sets NUMBA_NUM_THREADS and
OMP_NUM_THREADS for its ranks; configure() gives every other launcher (mpiexec, srun) the
same default, from the affinity sets of the host's ranks that the first world-sized
Communicator gathers (its shared-memory split): unbound ranks share all the host's cores,
ranks a launcher bound (`srun --cpu-bind`, `mpiexec --bind-to`) share only theirs. What the
user set wins: NUMBA_NUM_THREADS, OMP_NUM_THREADS (or MKL_NUM_THREADS) or a
torch.set_num_threads before mpidist's first communicator.
`setting()` says what was chosen and why (mpidist info, mpidist doctor).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from mpidist.checks import positive_int

__all__ = ["ThreadSetting", "cores", "affinity", "sharers", "default_threads", "configure",
           "setting", "core_per_rank", "ENV_MACHINE_RANKS"]


@dataclass(frozen=True)
class ThreadSetting:
    """Threads per rank for Numba and torch, and where each number came from."""
    numba: int
    numba_source: str
    torch: int | None           # None: torch not imported when the setting was made
    torch_source: str

    def describe(self) -> str:
        """One line, e.g. 'Numba 1 (2 core(s) / 2 rank(s) sharing them), torch 1 (...)'."""
        torch = "not imported" if self.torch is None else f"{self.torch} ({self.torch_source})"
        return f"Numba {self.numba} ({self.numba_source}), torch {torch}"


# ranks on this machine's cores where MPI sees them as several hosts (the simulated
# cluster's nodes share one machine): at least that many share each rank's cores
ENV_MACHINE_RANKS = "MPIDIST_MACHINE_RANKS"

_SETTING: ThreadSetting | None = None
_CHOICE: tuple[int, str] = (1, "")      # the default and its reason, once made
_OWN_CORE: list = [False]               # configure(): a core per rank on this node


def affinity() -> frozenset:
    """The cores this process may run on, by number."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def cores() -> int:
    """How many cores this process may run on."""
    return len(affinity())


def sharers(mine: frozenset, every: list) -> int:
    """How many of a host's ranks, given their affinity sets (every, this rank's included),
    may run on a core of this rank's set (mine): all of them when none is bound, one when
    a launcher bound each rank to cores of its own."""
    return max(1, sum(1 for s in every if s & mine))


def default_threads(ncores: int, ranks: int) -> int:
    """ncores shared among ranks ranks, at least one each."""
    return max(1, int(ncores) // max(1, int(ranks)))


def _numba(n: int, why: str) -> tuple[int, str]:
    if os.environ.get("NUMBA_NUM_THREADS"):
        return int(os.environ["NUMBA_NUM_THREADS"]), "NUMBA_NUM_THREADS"
    import numba                    # mpidist's kernels load it anyway
    # the calling thread's count: the one that runs the fused optimizers
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    return numba.get_num_threads(), why


def _torch(n: int, why: str) -> tuple[int | None, str]:
    if "torch" not in sys.modules:
        return None, "not imported"
    import torch                    # loaded by the user's script already
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if os.environ.get(var):
            return torch.get_num_threads(), var
    if torch.get_num_threads() != cores():       # torch starts with one per usable core
        return torch.get_num_threads(), "torch.set_num_threads"
    torch.set_num_threads(n)
    return n, why


def configure(ranks: int) -> ThreadSetting:
    """Once per process: set the defaults for ranks ranks sharing this rank's cores (sharers()
    over the host's ranks); later calls return the first setting (torch's part added if torch
    was imported since)."""
    global _SETTING, _CHOICE
    if _SETTING is None:
        if os.environ.get(ENV_MACHINE_RANKS):
            ranks = max(int(ranks), positive_int(ENV_MACHINE_RANKS, os.environ[ENV_MACHINE_RANKS]))
        c = cores()
        _OWN_CORE[0] = int(ranks) <= c
        _CHOICE = (default_threads(c, ranks), f"{c} core(s) / {ranks} rank(s) sharing them")
        _SETTING = ThreadSetting(*_numba(*_CHOICE), *_torch(*_CHOICE))
    elif _SETTING.torch is None and "torch" in sys.modules:     # torch came later
        _SETTING = ThreadSetting(_SETTING.numba, _SETTING.numba_source, *_torch(*_CHOICE))
    return _SETTING


def setting() -> ThreadSetting | None:
    """What configure() chose (None before the first world-sized Communicator)."""
    return _SETTING


def core_per_rank() -> bool:
    """Whether this rank has a core of its own (configure()'s count of the ranks sharing its
    cores at most their number, decided there once): then a thread may wait by polling
    without pause, as MPI's blocking waits do, without taking a core another rank computes
    on. False before configure()."""
    return _OWN_CORE[0]
