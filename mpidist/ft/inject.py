"""Fault injection for the fault-tolerance tests and `mpidist bench ft`: planned kills.

MPIDIST_FT_KILL="RANK@STEP,...": the rank (of the job at start) SIGKILLs itself a moment into
the step after STEP (0-50 ms, at most the length of the step before: a short job's last steps
can take less than 50 ms together, and a kill after them would find no step to break), or in
its first recovery once shrunk ("RANK@recovery"), first writing
the time to <out_dir>/killed-rank<RANK>.txt so that a test can measure from the kill. Kept
apart from the recovery protocol (mpidist.ft.recovery), which only asks it at two points.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time

from mpi4py import MPI

from mpidist.errors import ConfigError

__all__ = ["ENV_KILL", "KillPlan"]

ENV_KILL = "MPIDIST_FT_KILL"


class KillPlan:
    """This rank's planned kills, read from ENV_KILL (none without it)."""

    def __init__(self, out_dir: str, spec: str | None = None, rank: int | None = None):
        self.out_dir = out_dir
        rank = MPI.COMM_WORLD.Get_rank() if rank is None else rank
        self.rank = rank
        self.when = parse(os.environ.get(ENV_KILL, "") if spec is None else spec, rank)
        self._last = None               # when the step before completed (perf_counter)

    def after_step(self, step: int) -> None:
        """A step completed: die a moment into the next one if planned."""
        now, last = time.perf_counter(), self._last
        self._last = now
        if step in self.when:
            longest = 0.05 if last is None else min(0.05, now - last)
            threading.Timer(random.Random(step).uniform(0, longest), self.die).start()

    def in_recovery(self) -> None:
        """The communicator was just shrunk: die now if planned."""
        if "recovery" in self.when:
            self.die()

    def die(self) -> None:
        with open(os.path.join(self.out_dir, f"killed-rank{self.rank}.txt"), "w") as fh:
            fh.write(f"{time.time()}\n")
        os.kill(os.getpid(), signal.SIGKILL)


def parse(spec: str, rank: int) -> set:
    """The steps after which `rank` kills itself (and "recovery"), from "RANK@STEP,..."."""
    try:
        plan = [(int(r), w if w == "recovery" else int(w))
                for r, w in (item.split("@") for item in spec.replace(" ", "").split(",") if item)]
    except ValueError:
        raise ConfigError(f"{ENV_KILL} must look like 'RANK@STEP,...' (STEP a number or "
                          f"'recovery'), got {spec!r}") from None
    return {when for r, when in plan if r == rank}
