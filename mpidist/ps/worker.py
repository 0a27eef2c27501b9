"""The worker side of the parameter server: pull parameters with `Get`, push gradients with
`Accumulate(SUM)`, all under the passive-target epoch the windows keep open, so a worker
never waits for the server's code to move its data. A push takes a ticket that names the
accumulation slot it lands in, so it lands in exactly one update; a pull retries a server
that had started to overwrite its buffer (a seqlock). The steps are in Worker's docstring.
See docs/ARCHITECTURE.md (ps).
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from mpidist.backoff import Backoff
from mpidist.kernels.backend import is_cupy
from mpidist.ps.consistency import Consistency, StalenessRecord, Straggler
from mpidist.ps.windows import DONE, HALT, PAUSE, TICKET, VERSION, WRITING, CtrlLayout, Windows

__all__ = ["Worker", "TimedWait", "check_abort"]

_EPOCH_SHIFT = 32


class TimedWait:
    """The parameter server's pause between polls of a window: backoff.Backoff without
    spins, sleeping 20 us doubling to 1 ms, and a RuntimeError after `timeout` s."""

    def __init__(self, timeout: float, what: str):
        self.timeout, self.what = timeout, what
        self.reset()

    def wait(self) -> None:
        if not self._pause():
            raise RuntimeError(f"parameter server: timed out after {self.timeout:g} s waiting "
                               f"for {self.what}; a peer rank may have died or stalled "
                               f"(raise `timeout` if steps are legitimately this slow)")

    def reset(self, timeout: float | None = None) -> None:
        limit = self.timeout if timeout is None else timeout
        self._pause = Backoff(time.perf_counter() + limit, spins=0, longest=1e-3)


def check_abort(wins: Windows) -> None:
    """Raise on this rank if another rank of the run has failed."""
    culprit = wins.aborted_by()
    if culprit is not None:
        raise RuntimeError(f"parameter server: rank {culprit} failed; stopping this rank too")


class Worker:
    """One worker's view of the servers: pull(), push(grad), finish().

    index: this worker's number among the W workers; servers: server ranks in shard order;
    shards: chunk() (offset, count) of each server over the n flat parameters.

    Push (one round trip per phase, all servers at once):
      1. take a ticket: Fetch_and_op(+1) on every server's TICKET word; the epoch in the old
         value names the accumulation slot (epoch & 1) this push must go to;
      2. Accumulate the gradient shard into that slot and +1 into my per-worker count; Flush;
      3. Accumulate +1 into the slot's DONE counter: the server drains a slot only when DONE
         equals the tickets it closed, so a push lands in exactly one update.
    Pull: wait as the consistency model says; read VERSION, Get that parameter buffer, read
    WRITING; retry a server that had started to overwrite the buffer meanwhile (seqlock).
    Pause (checkpoints): after a push, stop_here() decides whether this worker stops at this
    step boundary; a paused worker sets PAUSED on every server and neither pulls nor pushes
    until resume() (see server.py and shard.py for the protocol).
    """

    def __init__(self, wins: Windows, *, index: int, workers: int, servers: list[int],
                 shards: list[tuple[int, int]], n: int, consistency: Consistency,
                 straggler: Straggler | None, timeout: float):
        self.wins, self.index, self.workers = wins, index, workers
        self.servers, self.shards, self.n = list(servers), list(shards), n
        self.consistency, self.straggler, self.timeout = consistency, straggler, timeout
        self.layout = CtrlLayout(workers)
        self.dtype = wins.dtype
        self.clock = 0                                   # my completed pushes
        self.record = StalenessRecord()
        S = len(self.servers)
        self.versions = np.zeros(S, np.int64)            # versions of my last pull
        self._vres, self._wres, self._tres = (np.zeros(S, np.int64) for _ in range(3))
        self._one = np.ones(1, np.int64)
        self._one64 = [self._one, MPI.INT64_T]
        self._applied = [np.zeros(workers, np.int64) for _ in range(S)]
        self._finished = False
        self._paused = False
        self._pulled_at = -1                             # clock of my last pull

    # ------------------------------------------------------------------ pull
    def pull(self, out: np.ndarray | None = None) -> np.ndarray:
        """The current parameters (after any wait the consistency model demands); into out
        when given, a NumPy or a CuPy array (staged through host memory: the servers'
        windows live there)."""
        self._check_live()
        host = self._out(out)
        self._wait_for_model()
        self._pulled_at = self.clock
        return self._deliver(self._get(host), out)

    def _out(self, out) -> np.ndarray:
        """The host buffer a pull reads into: out itself, or for a CuPy out (or none) a new
        NumPy array."""
        if out is None:
            return np.empty(self.n, self.dtype)
        if not ((isinstance(out, np.ndarray) or is_cupy(out)) and out.shape == (self.n,)
                and out.dtype == self.dtype and out.flags.c_contiguous):
            raise ValueError(f"out must be a contiguous {self.dtype} NumPy or CuPy array of "
                             f"shape ({self.n},)")
        return np.empty(self.n, self.dtype) if is_cupy(out) else out

    @staticmethod
    def _deliver(host: np.ndarray, out):
        """host, copied into out first where out is a CuPy array."""
        if is_cupy(out):
            out.set(host)
            return out
        return host

    def _get(self, out: np.ndarray) -> np.ndarray:
        """Read every server's current parameter buffer into out (seqlock retry)."""
        ctrl, data, wins = self.wins.ctrl, self.wins.data, self.wins
        pending = list(range(len(self.servers)))
        backoff = TimedWait(self.timeout, "a consistent parameter buffer")
        while pending:
            # 1. which version is current on each server
            for i in pending:
                wins.fetch_op(self.servers[i], VERSION, 0, MPI.NO_OP, self._vres[i:i + 1], flush=False)
            ctrl.Flush_all()
            # 2. get that buffer
            for i in pending:
                off, cnt = self.shards[i]
                disp = CtrlLayout.data_offsets(cnt)["param"][int(self._vres[i]) & 1]
                data.Get(out[off:off + cnt], self.servers[i], (disp, cnt, wins.mpi_dtype))
            data.Flush_all()
            # 3. was it overwritten meanwhile? (the server writes version v + 2 into it)
            for i in pending:
                wins.fetch_op(self.servers[i], WRITING, 0, MPI.NO_OP, self._wres[i:i + 1], flush=False)
            ctrl.Flush_all()
            pending = [i for i in pending if self._wres[i] > self._vres[i] + 1]
            if pending:
                check_abort(wins)
                backoff.wait()
        self.versions[:] = self._vres
        return out

    def _wait_for_model(self) -> None:
        model = self.consistency
        if model.model == "asp":
            return
        start = time.monotonic()
        backoff = TimedWait(self.timeout, f"the other workers ({model})")
        while True:
            version, min_applied = self._server_clocks()
            if not model.must_wait(self.clock, version, min_applied):
                break
            check_abort(self.wins)
            backoff.wait()
        if model.model == "ssp":
            self.record.gaps.append((self.clock, min_applied))
        self.record.wait_time += time.monotonic() - start

    def _server_clocks(self) -> tuple[int, int]:
        """(oldest server version, fewest applied pushes of any worker on any server)."""
        wins = self.wins
        if self.consistency.model == "bsp":
            for i, srv in enumerate(self.servers):
                wins.fetch_op(srv, VERSION, 0, MPI.NO_OP, self._vres[i:i + 1], flush=False)
            wins.ctrl.Flush_all()
            return int(self._vres.min()), 0
        applied, fin, paused = self._read_counts()
        # finished and paused workers push no more (in this segment)
        running = [a[(f == 0) & (p == 0)] for a, f, p in zip(applied, fin, paused)]
        return 0, int(min((a.min() for a in running if a.size), default=self.clock))

    def _read_counts(self) -> tuple[list, list, list]:
        """Every server's APPLIED, FIN and PAUSED arrays, read atomically."""
        wins, W = self.wins, self.workers
        stops = [np.zeros(2 * W, np.int64) for _ in self.servers]    # FIN, PAUSED: adjacent
        for i, srv in enumerate(self.servers):
            wins.read_words(srv, self.layout.applied, W, self._applied[i], flush=False)
            wins.read_words(srv, self.layout.fin, 2 * W, stops[i], flush=False)
        wins.ctrl.Flush_all()
        return self._applied, [s[:W] for s in stops], [s[W:] for s in stops]

    def global_clock(self) -> int:
        """Pushes applied on the first server, over all workers, divided by W: the number of
        data-parallel steps' worth of updates the servers have made so far."""
        applied = self.wins.read_words(self.servers[0], self.layout.applied, self.workers)
        return int(applied.sum()) // self.workers

    def wait_applied(self) -> None:
        """Wait until every server has applied all my pushes (the next pull holds them);
        only the servers are waited for, never the other workers."""
        start = time.monotonic()
        backoff = TimedWait(self.timeout, "the servers to apply this worker's pushes")
        while any(a[self.index] < self.clock for a in self._read_counts()[0]):
            check_abort(self.wins)
            backoff.wait()
        self.record.wait_time += time.monotonic() - start

    def pull_final(self, out: np.ndarray | None = None) -> np.ndarray:
        """After finish(): wait until every worker has finished and every push is applied,
        then pull the final parameters (identical on every worker)."""
        if not self._finished:
            raise RuntimeError("pull_final() comes after finish()")
        if self.wins.freed:
            raise RuntimeError("the parameter server's windows are freed; pull_final() only "
                               "inside its `with` block")
        backoff = TimedWait(self.timeout, "every worker to finish and every push to be applied")
        while True:
            applied, fin, _ = self._read_counts()
            if all((f > 0).all() and np.array_equal(a, f - 1) for a, f in zip(applied, fin)):
                break
            check_abort(self.wins)
            backoff.wait()
        return self._deliver(self._get(self._out(out)), out)

    # ------------------------------------------------------------------ push
    def push(self, grad: np.ndarray) -> None:
        """Add `grad` (the full flat gradient, NumPy or CuPy) into the servers' next update."""
        self._check_live()
        if is_cupy(grad):
            grad = grad.get()             # the servers' windows live in host memory
        if not isinstance(grad, np.ndarray) or grad.shape != (self.n,):
            raise ValueError(f"grad must be a NumPy or CuPy array of shape ({self.n},), got "
                             f"{getattr(grad, 'shape', type(grad).__name__)}")
        if self.consistency.model == "bsp" and self._pulled_at != self.clock:
            raise RuntimeError("BSP: call pull() before every push(), so each step's update "
                               "holds one gradient per worker")
        grad = np.ascontiguousarray(grad, dtype=self.dtype)
        if self.straggler is not None:
            self.straggler.stall(self.index, self.clock, self.workers)
        check_abort(self.wins)
        wins, ctrl, data = self.wins, self.wins.ctrl, self.wins.data
        # 1. a ticket from every server: the open epoch decides the slot
        for i, srv in enumerate(self.servers):
            ctrl.Fetch_and_op(self._one, self._tres[i:i + 1], srv, TICKET, MPI.SUM)
        ctrl.Flush_all()
        epochs = self._tres >> _EPOCH_SHIFT
        slots = (epochs & 1).tolist()
        # 2. the gradient shard and my count into that slot
        for i, srv in enumerate(self.servers):
            off, cnt = self.shards[i]
            disp = CtrlLayout.data_offsets(cnt)["acc"][slots[i]]
            data.Accumulate(grad[off:off + cnt], srv, (disp, cnt, wins.mpi_dtype), MPI.SUM)
            ctrl.Accumulate(self._one64, srv, (self.layout.cnt[slots[i]] + self.index, 1,
                                             MPI.INT64_T), MPI.SUM)
        data.Flush_all()
        ctrl.Flush_all()
        # 3. announce completion in the slot's DONE counter
        for i, srv in enumerate(self.servers):
            ctrl.Accumulate(self._one64, srv, (DONE[slots[i]], 1, MPI.INT64_T), MPI.SUM)
        ctrl.Flush_all()
        self.clock += 1
        self.record.staleness.append(int((epochs - self.versions).max()))

    # ------------------------------------------------------------------ pause
    def request_pause(self) -> None:
        """Ask every worker to pause at its next step boundary (PAUSE on the first server)."""
        self.wins.replace_words(self.servers[0], PAUSE, np.ones(1, np.int64))

    def stop_here(self, scheduled: bool) -> bool:
        """After a push: pause here (True) when `scheduled` (a checkpoint step), or when a
        pause was asked: under ASP/SSP at once, under BSP at the step HALT names, the same
        for every worker (the first server sets it before VERSION reaches that step)."""
        if not scheduled:
            lead = self.servers[0]
            if self.consistency.model == "bsp":
                start = time.monotonic()
                backoff = TimedWait(self.timeout, "the first server's update of this step")
                while self.wins.read(lead, VERSION) < self.clock:
                    check_abort(self.wins)
                    backoff.wait()
                self.record.wait_time += time.monotonic() - start
                halt = self.wins.read(lead, HALT)
                scheduled = 0 < halt <= self.clock
            else:
                scheduled = self.wins.read(lead, PAUSE) > 0
        if scheduled:
            for srv in self.servers:
                self.wins.replace_words(srv, self.layout.paused + self.index,
                                        np.array([self.clock + 1], np.int64), flush=False)
            self.wins.ctrl.Flush_all()
            self._paused = True
        return scheduled

    def resume(self) -> None:
        """Go on after a pause (the servers have reopened PAUSED)."""
        self._paused = False

    def restore(self, clock: int, version: int) -> None:
        """Start from a checkpoint: my clock, and the servers' version as my last pull."""
        self.clock = int(clock)
        self.versions[:] = int(version)
        self._pulled_at = -1
        self._finished = self._paused = False

    def finish(self) -> None:
        """Tell every server this worker has pushed its last gradient (idempotent)."""
        if self._finished:
            return
        for srv in self.servers:
            self.wins.replace_words(srv, self.layout.fin + self.index,
                                    np.array([self.clock + 1], np.int64), flush=False)
        self.wins.ctrl.Flush_all()
        self._finished = True

    def _check_live(self) -> None:
        if self.wins.freed:
            raise RuntimeError("the parameter server's windows are freed; pull/push only "
                               "inside its `with` block")
        if self._finished:
            raise RuntimeError("this worker called finish(); it can not pull or push again")
        if self._paused:
            raise RuntimeError("this worker is paused for a checkpoint; ParameterServer."
                               "end_segment() resumes it")
