"""Preemption: SIGTERM or SIGUSR1 (SLURM's --signal) asks every rank to finish its step,
write a checkpoint collectively and exit with REQUEUE_EXIT_CODE (the batch script turns it
into `scontrol requeue`). A signal reaches the ranks at different moments, or only some of
them, so the handler only sets a flag and the ranks agree on it once per step:

    with Preemption(comm) as pre:
        for step in ...:
            train_step()
            if pre.should_stop():            # collective: True on every rank or on none
                manager.save(step, ...); sys.exit(REQUEUE_EXIT_CODE)

Open MPI's mpiexec forwards SIGUSR1 to every rank; on SIGTERM it kills the ranks after
odls_base_sigkill_timeout seconds (the slurm/ scripts raise it). srun forwards both.
"""
from __future__ import annotations

import signal
import threading

from mpidist.comm import as_communicator

__all__ = ["Preemption", "REQUEUE_EXIT_CODE", "DEFAULT_SIGNALS"]

REQUEUE_EXIT_CODE = 75          # EX_TEMPFAIL: "try again later" -> the batch script requeues
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class Preemption:
    """Catch preemption signals; should_stop() agrees on them across ranks (collective).

    signals: names or numbers of the signals that request a checkpoint-and-exit.
    Install from the main thread (Python's rule for signal handlers).
    """

    def __init__(self, comm=None, signals=DEFAULT_SIGNALS):
        self.comm = as_communicator(comm)
        self.signals = tuple(_signum(s) for s in signals)
        if not self.signals:
            raise ValueError("give at least one signal, e.g. ('SIGTERM', 'SIGUSR1')")
        self.received: int | None = None       # the first signal caught on this rank
        self._previous: dict = {}

    def install(self) -> "Preemption":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Preemption.install() must run in the main thread "
                               "(Python delivers signals there)")
        for s in self.signals:
            if s not in self._previous:
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def uninstall(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()

    def _handler(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum

    @property
    def requested(self) -> bool:
        """This rank caught a signal (local, no communication)."""
        return self.received is not None

    def should_stop(self) -> bool:
        """Collective: True on every rank if any rank caught a preemption signal."""
        return self.comm.any(self.received is not None)

    def __enter__(self) -> "Preemption":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


def _signum(s) -> int:
    if isinstance(s, str):
        name = s.upper() if s.upper().startswith("SIG") else "SIG" + s.upper()
        if not hasattr(signal, name):
            raise ValueError(f"unknown signal {s!r}")
        return int(getattr(signal, name))
    if isinstance(s, int) and not isinstance(s, bool):
        return int(signal.Signals(s))
    raise TypeError(f"signals are names like 'SIGTERM' or numbers, got {s!r}")
