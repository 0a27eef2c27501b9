"""How steady the machine was while a benchmark ran: one reference copy, timed at points
through the run.

On a shared host, or a VM whose neighbours take memory bandwidth, plain memory traffic
speeds up and slows down by itself, and every collective and matmul moves with it (here a
single-core 64 MiB copy on an idle VM took 5.6 to 10.8 ms within 40 s). A benchmark that
prints this drift beside its figures says which differences it can resolve: two figures
taken at different points of the run that differ by less than the drift say nothing about
the code.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

__all__ = ["Steadiness", "REFERENCE_BYTES"]

REFERENCE_BYTES = 32 << 20          # larger than the caches: the copy runs at memory speed


class Steadiness:
    """Times the same copy of REFERENCE_BYTES on every rank at once, at each sample()."""

    def __init__(self, comm: MPI.Comm, nbytes: int = REFERENCE_BYTES):
        self._comm = comm
        self._src = np.ones(max(1, nbytes // 4), np.float32)
        self._dst = np.empty_like(self._src)
        np.copyto(self._dst, self._src)             # fault the pages in, untimed
        self.nbytes = self._src.nbytes
        self.samples: list[float] = []

    def sample(self) -> float:
        """Collective: seconds of the copy on the slowest rank (the same on every rank)."""
        self._comm.Barrier()
        t0 = time.perf_counter()
        np.copyto(self._dst, self._src)
        seconds = self._comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        self.samples.append(seconds)
        return seconds

    def summary(self) -> dict:
        """{"reference_bytes", "samples_s", "min_s", "median_s", "max_s", "max_over_min"}."""
        s = np.asarray(self.samples, float)
        if not s.size:
            return {"reference_bytes": self.nbytes, "samples_s": []}
        return {"reference_bytes": self.nbytes, "samples_s": s.tolist(), "min_s": float(s.min()),
                "median_s": float(np.median(s)), "max_s": float(s.max()),
                "max_over_min": float(s.max() / s.min())}

    def line(self) -> str:
        """One line for the report."""
        d = self.summary()
        if not d["samples_s"]:
            return "machine steadiness: not sampled"
        return (f"machine steadiness: a {self.nbytes >> 20} MiB copy on every rank at once took "
                f"{d['min_s'] * 1e3:.2f}-{d['max_s'] * 1e3:.2f} ms (median "
                f"{d['median_s'] * 1e3:.2f}) at {len(d['samples_s'])} points of this run, "
                f"max/min {d['max_over_min']:.2f}x: figures taken at different points that "
                f"differ by less than that are within the machine's own drift")
