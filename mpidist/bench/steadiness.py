"""How steady the machine was while a benchmark ran: two references, timed at points
through the run.

On a shared host, or a VM whose neighbours take memory bandwidth, plain memory traffic
speeds up and slows down by itself, and every collective and matmul moves with it. The speed
at which data moves between the ranks' caches changes on its own as well, even while a copy
stays put (timing.machine_state; figures in docs/PERFORMANCE.md). A benchmark that prints
this drift beside its figures says which differences it can resolve: two figures taken at
different points of the run that differ by less than the drift say nothing about the code.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from mpidist.collectives.tuning.timing import STATE_BYTES, machine_state

__all__ = ["Steadiness", "REFERENCE_BYTES"]

REFERENCE_BYTES = 32 << 20          # larger than the caches: the copy runs at memory speed


class Steadiness:
    """At each sample(): the same copy of REFERENCE_BYTES on every rank at once, and
    machine_state (an MPI_Allreduce of STATE_BYTES) where there is more than one rank."""

    def __init__(self, comm: MPI.Comm, nbytes: int = REFERENCE_BYTES):
        self._comm = comm
        self._src = np.ones(max(1, nbytes // 4), np.float32)
        self._dst = np.empty_like(self._src)
        np.copyto(self._dst, self._src)             # fault the pages in, untimed
        self.nbytes = self._src.nbytes
        self.samples: list[float] = []
        self.state_samples: list[float] = []

    def sample(self) -> float:
        """Collective: seconds of the copy on the slowest rank (the same on every rank)."""
        self._comm.Barrier()
        t0 = time.perf_counter()
        np.copyto(self._dst, self._src)
        seconds = self._comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        self.samples.append(seconds)
        if self._comm.Get_size() > 1:
            self.state_samples.append(machine_state(self._comm))
        return seconds

    def summary(self) -> dict:
        """{"reference_bytes", "samples_s", "min_s", "median_s", "max_s", "max_over_min",
        "state_bytes", "state_samples_s"}."""
        s = np.asarray(self.samples, float)
        out = {"reference_bytes": self.nbytes, "samples_s": s.tolist(),
               "state_bytes": STATE_BYTES, "state_samples_s": list(self.state_samples)}
        if s.size:
            out.update(min_s=float(s.min()), median_s=float(np.median(s)), max_s=float(s.max()),
                       max_over_min=float(s.max() / s.min()))
        return out

    def line(self) -> str:
        """One line for the report."""
        d = self.summary()
        if not d["samples_s"]:
            return "machine steadiness: not sampled"
        line = (f"machine steadiness: a {self.nbytes >> 20} MiB copy on every rank at once took "
                f"{d['min_s'] * 1e3:.2f}-{d['max_s'] * 1e3:.2f} ms (median "
                f"{d['median_s'] * 1e3:.2f}) at {len(d['samples_s'])} points of this run, "
                f"max/min {d['max_over_min']:.2f}x")
        state = np.asarray(self.state_samples)
        if state.size:
            line += (f"; a {STATE_BYTES >> 10} KiB MPI_Allreduce (data moving between the ranks' "
                     f"caches) {state.min() * 1e6:.0f}-{state.max() * 1e6:.0f} us (median "
                     f"{np.median(state) * 1e6:.0f}), max/min {state.max() / state.min():.2f}x")
        return (line + ": figures taken at different points that differ by less than that are "
                "within the machine's own drift")
