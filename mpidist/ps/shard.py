"""One parameter-server rank's loop over its shard of the parameters, and its statistics.

The server is a dedicated rank: passive-target RMA progresses only while the target is
inside MPI, so it polls its own window with atomic operations (each call drives progress),
backing off when idle, and computes only a short optimizer step per update. No progress
thread: MPI_THREAD_MULTIPLE is not assumed. See docs/ARCHITECTURE.md (ps).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from mpidist.errors import MismatchError
from mpidist.ps.consistency import Consistency
from mpidist.ps.windows import (DONE, HALT, PAUSE, TICKET, VERSION, WRITING, CtrlLayout, Windows,
                                pack_ticket, unpack_ticket)
from mpidist.ps.worker import TimedWait, check_abort

__all__ = ["ShardServer", "ServerStats", "SumUpdate"]


class SumUpdate:
    """The update rule `params += grads`: the servers hold the running sum of all pushes
    (a distributed accumulator; the exactness tests and the throughput benchmark use it)."""

    def __init__(self, offset: int = 0, count: int | None = None):
        self.offset, self.count = offset, count

    def step(self, params: np.ndarray, grads: np.ndarray):
        params += grads


@dataclass
class ServerStats:
    """What a server rank did: versions published, pushes drained, optimizer seconds."""
    updates: int = 0                 # versions published
    pushes: int = 0                  # pushes drained
    apply_time: float = 0.0          # seconds in the optimizer
    batch: list = field(default_factory=list)   # pushes per update


class ShardServer:
    """The loop of one server rank over its shard; one update is one epoch.

    1. read TICKET; if the consistency model is ready (BSP: one push per worker; ASP/SSP:
       any push), close the epoch by swapping TICKET for (epoch + 1) << 32, which moves
       later pushes to the other accumulation slot and returns the closed epoch's tickets;
    2. wait until the closed slot's DONE counter equals the tickets it had (bounded wait);
    3. drain: copy the slot's gradient sum and per-worker counts, zero them;
    4. apply the optimizer to the shard (gradient sum / W when averaging; an optimizer that
       sets counts_pushes gets the sum and the number of pushes it holds);
    5. publish: WRITING = v + 1, write parameter buffer (v + 1) & 1, VERSION = v + 1, then
       add the counts to APPLIED (the SSP clocks), so pushes seen applied are in VERSION.
    A push takes exactly one ticket and so lands in exactly one drained slot: no update is
    lost or applied twice under any interleaving.
    """

    def __init__(self, wins: Windows, *, params: np.ndarray, optimizer, consistency: Consistency,
                 workers: int, average: bool, timeout: float, lead: int):
        self.wins, self.params, self.optimizer = wins, params, optimizer
        self.lead = lead                  # the first server: it holds PAUSE and HALT
        self.consistency, self.workers = consistency, workers
        self.average, self.timeout = average, timeout
        self.layout = CtrlLayout(workers)
        self.me = wins.rank
        self.offsets = CtrlLayout.data_offsets(params.size)
        self.version = 0
        self.stats = ServerStats()
        self._grad = np.empty_like(params)
        self._zeros = np.zeros_like(params)
        self._counts = np.zeros(workers, np.int64)
        self._zero_counts = np.zeros(workers, np.int64)
        self._put_params(0)

    def _put_params(self, version: int) -> None:
        wins, cnt = self.wins, self.params.size
        wins.data.Put(self.params, self.me, (self.offsets["param"][version & 1], cnt, wins.mpi_dtype))
        wins.data.Flush(self.me)

    def serve(self, requested=None) -> ServerStats:
        """Run until every worker has finished or paused and every push is applied.

        requested: callable -> bool (this rank was signalled); once True, every worker is
        asked to pause (PAUSE on the first server)."""
        wins, W = self.wins, self.workers
        idle = TimedWait(self.timeout, "a push from any worker")
        asked = False
        while True:
            check_abort(wins)
            if requested is not None and not asked and requested():
                wins.replace_words(self.lead, PAUSE, np.ones(1, np.int64))
                asked = True
            # FIN/PAUSED before TICKET: a worker sets them after its last ticket, so "all
            # stopped and no open ticket" seen in this order means every push has been drained
            fin, paused = wins.read_words(self.me, self.layout.fin, 2 * W).reshape(2, W)
            stopped = np.maximum(fin, paused)
            word = wins.read(self.me, TICKET)
            epoch, entries = unpack_ticket(word)
            if self.consistency.server_ready(entries, W):
                # 1. close the epoch: later pushes go to the other slot; the swap returns
                #    every ticket of this epoch, including any taken since the read above
                epoch, entries = unpack_ticket(wins.swap(self.me, TICKET, pack_ticket(epoch + 1, 0)))
                if self.consistency.model == "bsp" and entries > W:
                    raise RuntimeError(f"BSP protocol violated: {entries} pushes in step {epoch} "
                                       f"for {W} workers")
                self._update(epoch & 1, entries)
                idle.reset()
                continue
            if entries == 0 and (stopped > 0).all():
                self._check_totals(stopped - 1)
                return self.stats
            if self.consistency.model == "bsp" and entries > 0:
                early = [w for w in range(W) if 0 < stopped[w] <= epoch + 1]
                if early:
                    raise MismatchError(f"BSP step {epoch}: worker(s) {early} stopped after "
                                        f"{[int(stopped[w]) - 1 for w in early]} steps while others "
                                        f"push step {epoch}; give every worker the same step count")
            idle.wait()

    def _update(self, slot: int, entries: int) -> None:
        wins, cnt, me = self.wins, self.params.size, self.me
        # 2. wait for the closed slot's pushes to complete
        done = TimedWait(self.timeout, f"{entries} pushes to complete in slot {slot}")
        while (got := wins.read(me, DONE[slot])) < entries:
            check_abort(wins)
            done.wait()
        if got != entries:
            raise RuntimeError(f"parameter-server slot {slot}: {got} pushes completed for "
                               f"{entries} tickets (protocol violated)")
        # 3. drain the slot and zero it for the epoch after next
        acc = (self.offsets["acc"][slot], cnt, wins.mpi_dtype)
        wins.data.Get(self._grad, me, acc)
        wins.read_words(me, self.layout.cnt[slot], self.workers, self._counts, flush=False)
        wins.data.Flush(me)
        wins.ctrl.Flush(me)
        wins.data.Put(self._zeros, me, acc)
        wins.replace_words(me, self.layout.cnt[slot], self._zero_counts, flush=False)
        wins.replace_words(me, DONE[slot], np.zeros(1, np.int64), flush=False)
        wins.data.Flush(me)
        wins.ctrl.Flush(me)
        # 4. the optimizer on my shard
        t0 = time.perf_counter()
        if self.average:
            self._grad /= self.workers
        if getattr(self.optimizer, "counts_pushes", False):
            self.optimizer.step(self.params, self._grad, pushes=entries)
        else:
            self.optimizer.step(self.params, self._grad)
        self.stats.apply_time += time.perf_counter() - t0
        # 5. publish the new version (seqlock: WRITING first, VERSION last); under BSP the
        #    first server fixes a requested pause at this version before publishing it
        v = self.version + 1
        if self.consistency.model == "bsp" and me == self.lead and wins.read(me, PAUSE) \
                and not wins.read(me, HALT):
            wins.replace_words(me, HALT, np.array([v], np.int64))
        wins.replace_words(me, WRITING, np.array([v], np.int64))
        self._put_params(v)
        wins.replace_words(me, VERSION, np.array([v], np.int64))
        # APPLIED after VERSION: a worker that sees its pushes applied (the SSP wait,
        # pull_final) then reads a VERSION that holds them
        wins.add_words(me, self.layout.applied, self._counts)
        self.version = v
        self.stats.updates += 1
        self.stats.pushes += entries
        self.stats.batch.append(entries)

    def restore(self, params: np.ndarray, version: int, applied: np.ndarray) -> None:
        """Start from a checkpoint, before any worker runs: my shard `params` published as
        `version` (also the epoch of the next tickets), APPLIED = applied (the clocks)."""
        wins, me, v = self.wins, self.me, int(version)
        self.params[...] = params
        self.version = v
        self._put_params(v)
        for index, value in ((TICKET, pack_ticket(v, 0)), (WRITING, v), (VERSION, v)):
            wins.replace_words(me, index, np.array([value], np.int64))
        wins.replace_words(me, self.layout.applied, np.asarray(applied, np.int64))

    def clear_pause(self) -> None:
        """After a pause (every worker stopped): reopen PAUSED, and PAUSE/HALT on the lead."""
        self.wins.replace_words(self.me, self.layout.paused, self._zero_counts)
        if self.me == self.lead:
            self.wins.replace_words(self.me, PAUSE, np.zeros(2, np.int64))

    def _check_totals(self, steps: np.ndarray) -> None:
        applied = self.wins.read_words(self.me, self.layout.applied, self.workers)
        if not np.array_equal(applied, steps):
            raise RuntimeError(f"parameter server rank {self.me}: applied pushes per worker "
                               f"{applied.tolist()} != pushed {steps.tolist()} (lost or "
                               f"duplicated updates)")
