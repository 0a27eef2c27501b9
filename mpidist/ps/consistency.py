"""Consistency models of the parameter server: BSP, ASP and SSP(s), the staleness record,
and the straggler option.

BSP applies an update only with every worker's gradient of the step (staleness 0), ASP
whatever has arrived, SSP(s) (Ho et al. 2013) lets a worker run at most s steps ahead of the
slowest (Consistency's docstring says exactly how). The clocks live in the servers' windows
and are read with Get_accumulate(NO_OP) (atomic per element); this module holds the pure
decisions and the record, `worker.py` the reads. See docs/ARCHITECTURE.md (ps).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Consistency", "Straggler", "StalenessRecord", "MODELS", "format_histogram"]

MODELS = ("bsp", "asp", "ssp")


@dataclass(frozen=True)
class Consistency:
    """Which model, and for SSP the bound s (a worker runs at most s steps ahead).

    - BSP (bulk synchronous): a server applies an update only when every worker has pushed its
      gradient of the current step, and a worker pulls step t's parameters only once version t
      is published, so every update uses every worker's gradient of that step (staleness 0).
    - ASP (asynchronous): a server applies whatever has been pushed as soon as it arrives;
      workers never wait. A push's staleness is the number of updates the server applied
      between the worker's pull and the update that includes the push.
    - SSP(s) (stale synchronous parallel, Ho et al. 2013): like ASP, but a worker at clock c
      (its number of completed pushes) waits until every worker's clock, as counted by every
      server in its window (the pushes the server has *applied*), is at least c - s. Reading
      applied counts rather than pushed ones also guarantees SSP's read condition: the
      parameters pulled afterwards contain every worker's updates older than s steps.
    """
    model: str = "bsp"
    staleness: int = 0

    def __post_init__(self):
        if not isinstance(self.model, str) or self.model.lower() not in MODELS:
            raise ValueError(f"consistency must be one of {', '.join(MODELS)}, "
                             f"got {self.model!r}")
        object.__setattr__(self, "model", self.model.lower())
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, (int, np.integer)) \
                or self.staleness < 0:
            raise ValueError(f"staleness must be a non-negative int, got {self.staleness!r}")
        object.__setattr__(self, "staleness", int(self.staleness))
        if self.model != "ssp" and self.staleness:
            raise ValueError(f"staleness={self.staleness} only applies to consistency='ssp', "
                             f"not {self.model!r}; drop it or use 'ssp'")

    @classmethod
    def parse(cls, value, staleness: int | None = None) -> "Consistency":
        """'bsp' | 'asp' | 'ssp' | 'ssp(3)' | a Consistency -> a Consistency."""
        if isinstance(value, Consistency):
            return value if staleness is None else cls(value.model, staleness)
        if not isinstance(value, str):
            raise TypeError(f"consistency must be a str or Consistency, got {type(value).__name__}")
        text = value.strip().lower()
        if text.startswith("ssp(") and text.endswith(")"):
            inner = text[4:-1]
            if not inner.isdigit():
                raise ValueError(f"write SSP's bound as ssp(s) with an integer s, got {value!r}")
            return cls("ssp", int(inner) if staleness is None else staleness)
        return cls(text, 0 if staleness is None else staleness)

    # -- the server's rule: may it apply the pushes it holds now?
    def server_ready(self, entries: int, workers: int) -> bool:
        """BSP waits for one push per worker; ASP and SSP apply whatever has arrived."""
        if self.model == "bsp":
            return entries >= workers
        return entries > 0

    # -- the worker's rule before a pull
    def must_wait(self, clock: int, version: int, min_applied: int) -> bool:
        """True while a worker at `clock` must not pull yet.

        version: the oldest server version (updates applied); min_applied: the smallest
        count of applied pushes of any worker on any server.
        """
        if self.model == "bsp":
            return version < clock
        if self.model == "ssp":
            return clock - min_applied > self.staleness
        return False

    def __str__(self) -> str:
        return f"ssp({self.staleness})" if self.model == "ssp" else self.model


@dataclass(frozen=True)
class Straggler:
    """Slow workers down by `delay` seconds per step.

    worker: the index (among the workers) of a persistent straggler; None: a different
    worker at every step, drawn from a generator seeded with (seed, step), so every rank
    agrees who is slow (transient stragglers, where SSP pays off).
    """
    worker: int | None = 0
    delay: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.worker is not None and (isinstance(self.worker, bool) or not isinstance(
                self.worker, (int, np.integer)) or self.worker < 0):
            raise ValueError(f"straggler worker must be None or a non-negative int, "
                             f"got {self.worker!r}")
        if not isinstance(self.delay, (int, float)) or not self.delay >= 0:
            raise ValueError(f"straggler delay must be a non-negative number of seconds, "
                             f"got {self.delay!r}")

    def slow(self, worker: int, step: int, workers: int) -> bool:
        """Is `worker` the slow one at `step`?"""
        if self.worker is not None:
            return worker == self.worker
        return int(np.random.default_rng([self.seed, step]).integers(workers)) == worker

    def stall(self, worker: int, step: int, workers: int) -> None:
        """Sleep if `worker` is slow at `step`."""
        if self.delay > 0 and self.slow(worker, step, workers):
            time.sleep(self.delay)


@dataclass
class StalenessRecord:
    """What one worker saw: staleness of each push, SSP clock gaps, time spent waiting."""
    staleness: list = field(default_factory=list)   # per push: max over servers
    gaps: list = field(default_factory=list)        # per pull: (clock, min applied clock)
    wait_time: float = 0.0                          # seconds blocked by the model

    def histogram(self, length: int | None = None) -> np.ndarray:
        """Counts of pushes by staleness 0, 1, 2, ... (padded to `length`)."""
        vals = np.asarray(self.staleness, dtype=np.int64)
        n = max(int(vals.max()) + 1 if vals.size else 0, length or 0)
        return np.bincount(vals, minlength=n).astype(np.int64)

    def max_gap(self) -> int:
        """Largest clock - min_applied seen when a pull went ahead (SSP: never > s)."""
        return max((c - m for c, m in self.gaps), default=0)


def format_histogram(hist: np.ndarray, width: int = 40) -> str:
    """A small text bar chart of a staleness histogram."""
    hist = np.asarray(hist)
    total = int(hist.sum())
    if total == 0:
        return "(no pushes)"
    top = int(hist.max())
    lines = []
    for k, n in enumerate(hist):
        if n:
            bar = "#" * max(1, round(width * int(n) / top))
            lines.append(f"{k:>4} | {bar} {int(n)} ({100.0 * int(n) / total:.1f}%)")
    return "\n".join(lines)
