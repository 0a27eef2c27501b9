"""Intra-op threads per rank: Numba's and torch's default to the cores this rank may use
(os.sched_getaffinity) shared among the ranks on its node.

Left alone, every rank of a plain `mpiexec -n 2` starts one Numba thread and one torch
thread per core, and the node runs ranks x cores threads on its cores: the fused kernels
then wait on each other's threads. `python -m mpidist.launcher` sets NUMBA_NUM_THREADS and
OMP_NUM_THREADS for its ranks; configure() gives every other launcher (mpiexec, srun) the
same default, from the node-local rank count the first world-sized Communicator finds
(its shared-memory split). What the user set wins: NUMBA_NUM_THREADS, OMP_NUM_THREADS (or
MKL_NUM_THREADS) or a torch.set_num_threads before mpidist's first communicator.
`setting()` says what was chosen and why (mpidist info, mpidist doctor).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

__all__ = ["ThreadSetting", "cores", "default_threads", "configure", "setting", "core_per_rank"]


@dataclass(frozen=True)
class ThreadSetting:
    """Threads per rank for Numba and torch, and where each number came from."""
    numba: int
    numba_source: str
    torch: int | None           # None: torch not imported when the setting was made
    torch_source: str

    def describe(self) -> str:
        """One line, e.g. 'Numba 1 (2 cores / 2 ranks on the node), torch 1 (...)'."""
        torch = "not imported" if self.torch is None else f"{self.torch} ({self.torch_source})"
        return f"Numba {self.numba} ({self.numba_source}), torch {torch}"


_SETTING: ThreadSetting | None = None
_CHOICE: tuple[int, str] = (1, "")      # the default and its reason, once made
_OWN_CORE: list = [False]               # configure(): a core per rank on this node


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(ncores: int, local_ranks: int) -> int:
    """ncores shared among local_ranks ranks, at least one each."""
    return max(1, int(ncores) // max(1, int(local_ranks)))


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


def configure(local_ranks: int) -> ThreadSetting:
    """Once per process: set the defaults for local_ranks ranks on this node (the world's
    node-local size); later calls return the first setting (torch's part added if torch
    was imported since)."""
    global _SETTING, _CHOICE
    if _SETTING is None:
        c = cores()
        _OWN_CORE[0] = int(local_ranks) <= c
        _CHOICE = (default_threads(c, local_ranks), f"{c} core(s) / {local_ranks} rank(s) "
                                                    f"on the node")
        _SETTING = ThreadSetting(*_numba(*_CHOICE), *_torch(*_CHOICE))
    elif _SETTING.torch is None and "torch" in sys.modules:     # torch came later
        _SETTING = ThreadSetting(_SETTING.numba, _SETTING.numba_source, *_torch(*_CHOICE))
    return _SETTING


def setting() -> ThreadSetting | None:
    """What configure() chose (None before the first world-sized Communicator)."""
    return _SETTING


def core_per_rank() -> bool:
    """Whether each rank on this node has a core of its own (configure()'s node-local rank
    count at most this rank's cores, decided there once): then a thread may wait by polling
    without pause, as MPI's blocking waits do, without taking a core another rank computes
    on. False before configure()."""
    return _OWN_CORE[0]
