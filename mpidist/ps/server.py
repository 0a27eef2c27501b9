"""Parameter-server ranks over MPI-3 one-sided communication.

S server ranks, placed by `place_servers` (spread over the nodes, highest local ranks
first, so rank 0 stays a worker), each own the chunk(n, s, S) shard of the flat parameters
in windows created with `MPI.Win.Allocate` (layout in `windows.py`). Workers pull with
`Get` and push with `Accumulate(SUM)` under passive-target `Lock_all` + `Flush`.

Progress. Passive-target RMA only progresses while the target rank is inside MPI: with
Open MPI's point-to-point RMA path a target computing outside MPI served about one
operation per second (measured here). Servers are therefore *dedicated* ranks that never
compute outside a short optimizer step: their loop polls their own window with atomic
operations (each call drives MPI progress), sleeping at most 1 ms between polls when idle.
No progress thread is used: MPI_THREAD_MULTIPLE is not assumed of the library.

Server loop (one update = one epoch):
  1. read TICKET; if the consistency model is ready (BSP: one push per worker; ASP/SSP:
     any push), close the epoch by swapping TICKET for (epoch + 1) << 32 (Fetch_and_op
     REPLACE), which atomically moves later pushes to the other accumulation slot and
     returns the closed epoch's tickets;
  2. wait until the closed slot's DONE counter equals the tickets it had (bounded wait);
  3. drain: copy the slot's gradient sum and per-worker counts, zero them;
  4. apply the optimizer to the shard (gradient sum / W when averaging);
  5. publish: WRITING = v + 1, write parameter buffer (v + 1) & 1, VERSION = v + 1, then
     add the counts to APPLIED (the SSP clocks), so pushes seen applied are in VERSION.
A push takes exactly one ticket and so lands in exactly one drained slot: no update is lost
or applied twice under any interleaving. At the end each server checks that its APPLIED
counts equal every worker's step count.

Checkpoints (segments). serve() also returns when every worker has *paused* (PAUSED[w]
set after its last push, like FIN) and every push is applied: all ranks then stand at one
step boundary, end_segment() reopens the pause words and agrees on the clocks (collective),
the ranks write a checkpoint together, and training goes on with the next serve(). A pause
comes at the checkpoint interval, or when any rank asks (request_pause: PAUSE on the first
server): under ASP/SSP every worker pauses after its current push; under BSP the first
server, at its next update, fixes HALT = the step at which every worker pauses (it is set
before that update's VERSION, and a worker reads it once VERSION reaches its clock), so all
workers stop after the same step. restore() starts the windows from a checkpoint.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from mpidist.comm import as_communicator
from mpidist.errors import MismatchError
from mpidist.partition import chunk
from mpidist.ps.consistency import Consistency, StalenessRecord, Straggler
from mpidist.ps.windows import (DONE, HALT, MPI_DTYPES, PAUSE, TICKET, VERSION, WRITING, CtrlLayout,
                                Windows, pack_ticket, unpack_ticket)
from mpidist.ps.worker import Backoff, Worker, check_abort

__all__ = ["ParameterServer", "ShardServer", "SumUpdate", "place_servers", "ServerStats"]


def place_servers(nodes: list[int], servers: int) -> list[int]:
    """Server ranks for `servers` servers, given each rank's node.

    Round-robin over the nodes (so server traffic spreads over the network links), taking
    each node's highest ranks first; at least one rank is left as a worker.
    """
    nodes = [int(x) for x in nodes]
    if isinstance(servers, bool) or not isinstance(servers, (int, np.integer)) \
            or not 1 <= servers < len(nodes):
        raise ValueError(f"servers must be an int in [1, {len(nodes) - 1}] for {len(nodes)} "
                         f"ranks (at least one rank must stay a worker), got {servers!r}")
    stacks = {}
    for rank, node in enumerate(nodes):
        stacks.setdefault(node, []).append(rank)      # popped from the end: highest first
    order = sorted(stacks)
    chosen: list[int] = []
    while len(chosen) < servers:
        for node in order:
            if stacks[node] and len(chosen) < servers:
                chosen.append(stacks[node].pop())
    return sorted(chosen)


class SumUpdate:
    """The update rule `params += grads`: the servers hold the running sum of all pushes
    (a distributed accumulator; the exactness tests and the throughput benchmark use it)."""

    def __init__(self, offset: int = 0, count: int | None = None):
        self.offset, self.count = offset, count

    def step(self, params: np.ndarray, grads: np.ndarray):
        params += grads


@dataclass
class ServerStats:
    updates: int = 0                 # versions published
    pushes: int = 0                  # pushes drained
    apply_time: float = 0.0          # seconds in the optimizer
    batch: list = field(default_factory=list)   # pushes per update


class ShardServer:
    """The loop of one server rank over its shard."""

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
        idle = Backoff(self.timeout, "a push from any worker")
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
        done = Backoff(self.timeout, f"{entries} pushes to complete in slot {slot}")
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


class ParameterServer:
    """A parameter-server run over a communicator (collective to create and to close).

        with ParameterServer(params, servers=2, consistency="ssp", staleness=2,
                             optimizer=lambda off, cnt: SGD(layout, lr=0.1, offset=off, count=cnt)) as ps:
            if ps.is_server:
                ps.serve()
            else:
                for t in range(steps):
                    w = ps.worker.pull()
                    ps.worker.push(grad(w))
                ps.worker.finish()
            stats = ps.stats()

    params: the initial flat parameters (float32/float64, identical on every rank).
    optimizer: factory (offset, count) -> object with .step(params, grads) updating its
      [offset, offset + count) range in place (mpidist.optim's contract); default SumUpdate.
    average: servers apply (sum of pushed gradients) / W, so one round of W pushes weighs
      what one data-parallel step does in every consistency model.
    timeout: seconds any wait may last before it raises (a dead peer fails, never hangs).
    """

    def __init__(self, params: np.ndarray, *, comm=None, servers: int = 1,
                 consistency="bsp", staleness: int | None = None, optimizer=None,
                 average: bool = True, straggler: Straggler | None = None,
                 timeout: float = 60.0):
        c = as_communicator(comm)
        if not isinstance(params, np.ndarray) or params.ndim != 1:
            raise TypeError(f"params must be a 1-D NumPy array (the flat parameters), got "
                            f"{type(params).__name__} of shape {getattr(params, 'shape', None)}")
        if params.dtype not in MPI_DTYPES:
            raise TypeError(f"params dtype must be float32 or float64 (MPI accumulates those), "
                            f"got {params.dtype}")
        if c.size < 2:
            raise ValueError("a parameter server needs at least 2 ranks (a server and a worker); "
                             "run under mpiexec -n 2 or more")
        model = Consistency.parse(consistency, staleness)
        if straggler is not None and not isinstance(straggler, Straggler):
            raise TypeError(f"straggler must be a Straggler or None, got {type(straggler).__name__}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        n = params.size
        c.check_same((n, params.dtype.str, int(servers), str(model), bool(average)),
                     "parameter-server configuration (n, dtype, servers, consistency, average)")
        self.comm = c
        self.server_ranks = place_servers(c.comm.allgather(c.node), servers)
        if n < len(self.server_ranks):
            raise ValueError(f"{n} parameters can not be sharded over {servers} servers; "
                             f"use at most {n} servers")
        self.worker_ranks = [r for r in range(c.size) if r not in self.server_ranks]
        self.is_server = c.rank in self.server_ranks
        self.num_workers = len(self.worker_ranks)
        self.consistency = model
        self.shards = [chunk(n, s, len(self.server_ranks)) for s in range(len(self.server_ranks))]
        self.server: ShardServer | None = None
        self.worker: Worker | None = None
        self._stats_server = ServerStats()
        self.windows = None
        error = None
        try:
            if self.is_server:
                s = self.server_ranks.index(c.rank)
                offset, count = self.shards[s]
            else:
                offset, count = 0, 0
            self.windows = Windows(c.comm, is_server=self.is_server, workers=self.num_workers,
                                   count=count, dtype=params.dtype)
            if self.is_server:
                shard = params[offset:offset + count]
                if optimizer is not None:
                    # compile the optimizer's kernels now, on a throwaway instance, so JIT
                    # time does not stall the first update while the workers already run
                    optimizer(offset, count).step(shard.copy(), np.zeros_like(shard))
                opt = (optimizer or SumUpdate)(offset, count)
                self.server = ShardServer(self.windows, params=shard.copy(),
                                          optimizer=opt, consistency=model,
                                          workers=self.num_workers, average=average,
                                          timeout=timeout, lead=self.server_ranks[0])
            else:
                self.worker = Worker(self.windows, index=self.worker_ranks.index(c.rank),
                                     workers=self.num_workers, servers=self.server_ranks,
                                     shards=self.shards, n=n, consistency=model,
                                     straggler=straggler, timeout=timeout)
        except Exception as exc:          # noqa: BLE001 - re-raised on every rank below
            error = exc
        try:
            c.raise_if_any(error)         # also the barrier: windows are ready everywhere
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ roles
    @property
    def worker_index(self) -> int | None:
        return None if self.is_server else self.worker_ranks.index(self.comm.rank)

    def serve(self, requested=None) -> ServerStats:
        """Server ranks: run the server loop until every worker has finished or paused.
        requested: callable -> bool; once True, every worker is asked to pause."""
        if not self.is_server:
            raise RuntimeError("serve() is for server ranks; check ps.is_server")
        self._check_open()
        self._stats_server = self.server.serve(requested)
        return self._stats_server

    # ------------------------------------------------------------------ checkpoints
    def request_pause(self) -> None:
        """Any rank: ask every worker to pause at its next step boundary (PAUSE)."""
        self._check_open()
        self.windows.replace_words(self.server_ranks[0], PAUSE, np.ones(1, np.int64))

    def end_segment(self) -> dict:
        """Collective, once every worker has paused or finished and every server has returned
        from serve(): reopen the pause words (before anyone can push again), then agree.
        -> {"clocks": pushes applied per worker, "versions": updates per server,
            "optim_steps": per server, the optimizer's step_count (else its version)}."""
        self._check_open()
        mine = None
        if self.is_server:
            self.server.clear_pause()
            srv = self.server
            mine = (self.windows.read_words(srv.me, srv.layout.applied, self.num_workers),
                    srv.version, int(getattr(srv.optimizer, "step_count", srv.version)))
        else:
            self.worker.resume()
        every = self.comm.comm.allgather(mine)
        servers = [every[r] for r in self.server_ranks]
        return {"clocks": servers[0][0], "versions": [v for _, v, _ in servers],
                "optim_steps": [o for _, _, o in servers]}

    def restore(self, clocks, version: int, shard: np.ndarray | None = None) -> None:
        """Collective, before any pull or push: start from a checkpoint at `version` updates
        with per-worker clocks `clocks`; servers publish `shard` (their chunk() of the flat
        parameters)."""
        self._check_open()
        clocks = np.asarray(clocks, np.int64)
        error = None
        try:
            if clocks.shape != (self.num_workers,):
                raise ValueError(f"clocks must hold one count per worker ({self.num_workers}), "
                                 f"got shape {clocks.shape}")
            if self.is_server:
                self.server.restore(shard, version, clocks)
            else:
                self.worker.restore(int(clocks[self.worker_index]), version)
        except (TypeError, ValueError) as exc:
            error = exc
        self.comm.raise_if_any(error)     # also the barrier: nobody pushes before all restored

    def run(self, grad_fn, steps: int) -> None:
        """Both roles: servers serve; workers do `steps` of pull -> grad_fn(params, t) -> push."""
        if self.is_server:
            self.serve()
            return
        self._check_open()
        for t in range(steps):
            params = self.worker.pull()
            self.worker.push(grad_fn(params, t))
        self.worker.finish()

    def parameters(self) -> np.ndarray:
        """Collective: the servers' parameters, assembled on every rank (also after close)."""
        parts = self.comm.comm.allgather(self.server.params if self.is_server else None)
        return np.concatenate([parts[r] for r in self.server_ranks])

    def stats(self) -> dict:
        """Collective: staleness histogram, SSP max gap, waits and update counts of the run."""
        rec = self.worker.record if self.worker is not None else StalenessRecord()
        mine = (rec.histogram(), rec.max_gap(), rec.wait_time,
                self._stats_server.updates, self._stats_server.pushes)
        every = self.comm.comm.allgather(mine)
        width = max(len(h) for h, *_ in every)
        hist = sum((np.pad(h, (0, width - len(h))) for h, *_ in every), np.zeros(width, np.int64))
        workers = [every[r] for r in self.worker_ranks]
        servers = [every[r] for r in self.server_ranks]
        return {"consistency": str(self.consistency), "workers": self.num_workers,
                "servers": len(self.server_ranks), "staleness_histogram": hist,
                "max_clock_gap": max(g for _, g, *_ in workers),
                "wait_time": [w for _, _, w, *_ in workers],
                "updates": [u for *_, u, _ in servers], "pushes": [p for *_, p in servers]}

    # ------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self.windows is None or self.windows.freed:
            raise RuntimeError("the parameter server is closed; use it inside its `with` block")

    @property
    def closed(self) -> bool:
        return self.windows is None or self.windows.freed

    def close(self) -> None:
        """Free the windows (collective; exactly once, later calls do nothing)."""
        if self.windows is not None:
            self.windows.free()

    def abort(self) -> None:
        """Tell every other rank that this one failed: their waits raise at once."""
        if not self.closed:
            self.windows.abort(r for r in range(self.comm.size) if r != self.comm.rank)

    def __enter__(self) -> "ParameterServer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Free the windows, then fail on every rank if any rank failed (RemoteError on the
        others); a failing rank first tells the others, so none waits out its timeout."""
        if exc is not None:
            self.abort()
        self.close()
        if exc is None or isinstance(exc, Exception):
            self.comm.raise_if_any(exc)
