"""Parameter-server ranks over MPI-3 one-sided communication: placement and the collective run.

S server ranks, placed by `place_servers` (spread over the nodes, highest local ranks first,
so rank 0 stays a worker), each own the chunk(n, s, S) shard of the flat parameters in
windows created with `MPI.Win.Allocate` (layout in `windows.py`). Workers pull with `Get`
and push with `Accumulate(SUM)` under passive-target `Lock_all` + `Flush`; each server runs
the loop of `shard.ShardServer`. At a checkpoint every worker pauses at one step boundary
(under BSP the first server fixes the step, HALT), every push is applied, end_segment()
agrees on the clocks and the ranks write together; restore() starts from a checkpoint.
See docs/ARCHITECTURE.md (ps).
"""
from __future__ import annotations

import numpy as np

from mpidist.comm import as_communicator
from mpidist.partition import chunk
from mpidist.ps.consistency import Consistency, StalenessRecord, Straggler
from mpidist.ps.shard import ServerStats, ShardServer, SumUpdate
from mpidist.ps.windows import MPI_DTYPES, PAUSE, Windows
from mpidist.ps.worker import Worker

__all__ = ["ParameterServer", "place_servers", "servers_error"]


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


def servers_error(servers: int, world_size: int | None) -> list[str]:
    """A job config's [parallel] servers against its world size: [] or the one message."""
    if world_size is None or servers < world_size:
        return []
    return [f"[parallel] servers = {servers} leaves no worker among {world_size} ranks"]


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
