"""[job] fault_tolerance = "shrink": the training loop keeps going when a rank dies.

The loop (engine.loop) runs its body through Resilience.run. When a collective anywhere in it
raises a process failure (MPI_ERR_PROC_FAILED, or MPI_ERR_REVOKED once a survivor has
revoked), every survivor revokes and shrinks the communicator, agrees on the step to continue
from and where its tensors come from, rebuilds the strategy on the new Communicator and goes
on (the steps are in Resilience's docstring). A failure during a recovery starts another
one. Each recovery is logged on rank 0 and listed in summary.json under "recoveries".
See docs/CHECKPOINTS.md (surviving a lost rank) and docs/ARCHITECTURE.md (fault tolerance).
"""
from __future__ import annotations

import collections
import logging
import os
import time

import mpi4py
import numpy as np
from mpi4py import MPI

from mpidist import ulfm
from mpidist.compress import wire
from mpidist.diloco.groups import group_colors
from mpidist.diloco.replicas import combine_replicas, replica_versions
from mpidist.errors import ConfigError
from mpidist.ft.inject import KillPlan
from mpidist.state import InMemoryState, TensorPiece, assemble_state
from mpidist.strategy.metrics import append_step_if_missing, setup_logging

__all__ = ["Resilience", "SHARD_ROUTES", "replica", "pieces_cover"]

SHARD_ROUTES = ("neighbour", "checkpoint")
log = logging.getLogger("mpidist")
_REGROUP_TAG = 77        # diloco's inner states to the survivors behind, on the shrunk communicator


class Resilience:
    """The loop's recovery hook. Construction is local; ULFM must be active (same on every
    rank of a job, so the ConfigError is raised everywhere). On a failure every survivor:

      1. revokes and shrinks      ulfm.shrink: pending operations fail everywhere, the
                                  survivors agree on a communicator without the dead ranks
                                  and get a new mpidist Communicator (node / inter-node
                                  communicators, worker threads, scratch and the guard's
                                  records start afresh)
      2. agrees on the state      on the step to continue from and where its tensors come from:
            dp                    every survivor holds a whole replica; they differ by at most
                                  the step in flight: the newest one is broadcast from the
                                  lowest rank holding it
            zero, "neighbour"     after every step each rank keeps a copy of its shard and
                                  sends one to its right neighbour (the last two steps of
                                  each); the newest step whose every piece survives somewhere
                                  is assembled
            zero, "checkpoint"    the newest checkpoint, read at the new size (the steps since
                                  it are redone); also the fallback when neighbours died together
            diloco, local_sgd     ("groups") every survivor holds theta_outer and its momentum
                                  and its group's whole inner state: theta_outer of the newest
                                  outer sync a survivor completed (a failure inside the exchange
                                  can leave some a sync ahead) from the lowest rank holding it;
                                  survivors stay in their groups ([parallel] groups), each group
                                  takes the inner state of its member with the newest inner
                                  step; a group with no survivor is dropped (engine.diloco)
      3. rebuilds and continues   the loop body runs again on the new Communicator: strategy
                                  and partition, data split (the global batch stays the same,
                                  each survivor reads more rows), checkpoint hook, metrics
                                  writer (the new rank 0 takes over metrics and checkpoints);
                                  the strategy loads the agreed state before its first step

    summary.json's "recoveries" list, per recovery: the last step completed before it, the
    lost ranks (as ranks of the job at start), the new world size, the step continued from,
    the steps redone and the seconds from noticing the failure to the first step after it;
    for diloco also the number of groups now, the dropped groups (numbered as before) and the
    inner step each group's kept state had reached.
    """

    def __init__(self, config: dict, comm):
        if not ulfm.active():
            raise ConfigError("[job] fault_tolerance = 'shrink' needs MPI's fault-tolerance extension "
                              "(ULFM), active in this job: build the FT environment with "
                              "`MPIDIST_MPI=ompi5-ft bash scripts/setup_env.sh` and start the job from "
                              "it with `python -m mpidist.launcher --ft -n N -- mpidist train ...` "
                              "(or `mpiexec --with-ft ulfm ...`)")
        if mpi4py.rc.fast_reduce:
            # its reductions of Python objects run over a hidden duplicate communicator that
            # a revoke does not reach: a rank could wait there forever for a survivor
            raise ConfigError("[job] fault_tolerance = 'shrink' needs MPI4PY_RC_FAST_REDUCE=0 in every "
                              "rank's environment (python -m mpidist.launcher --ft sets it; with "
                              "mpirun add -x MPI4PY_RC_FAST_REDUCE=0)")
        self.comm = comm
        strategy = config["parallel"]["strategy"]
        self.route = config["job"]["shard_restore"] if strategy == "zero" else \
            "groups" if strategy in ("diloco", "local_sgd") else "replica"
        self.recoveries: list[dict] = []
        self._groups: list | None = None   # groups route: the survivors' groups, for the rebuilt strategy
        self._detail: dict = {}            # groups route: what the record adds
        self._holder = None        # dp: what this rank restores from (a strategy or an InMemoryState)
        # zero: copies of the last two steps' pieces, (step, index, raw message, scalars) each
        self._mine: collections.deque = collections.deque(maxlen=2)
        self._theirs: collections.deque = collections.deque(maxlen=2)  # the left neighbour's
        self._index = self._left = None     # what my copy and the left one's hold (_pair)
        self._restore = None       # what the next strategy loads: a state, "checkpoint" or None
        self._pending: dict | None = None   # the recovery waiting for its first completed step
        self._out_dir = config["job"]["out_dir"]
        self._record = None        # the metrics record of this rank's newest completed step
        self._unwritten = None     # that of the newest step a survivor completed, for rank 0
        self._kills = KillPlan(self._out_dir)      # the tests' planned kills (ft.inject)

    # ------------------------------------------------------------------ the loop's calls
    def run(self, body, config: dict, *args) -> dict:
        """body(config, comm, *args, resilience=self) until it returns, recovering from
        every process failure it raises; returns its summary."""
        while True:
            try:
                return body(config, self.comm, *args, resilience=self)
            except Exception as exc:
                if ulfm.failure_of(exc) is None and not ulfm.broken(self.comm, wait=1.0):
                    raise
                self._recover(time.perf_counter())
                if self.route == "groups":          # diloco: the survivors keep their groups
                    config = {**config, "parallel": {**config["parallel"], "groups": self._groups or []}}

    def attach(self, strategy, hook) -> None:
        """After the loop built strategy and hook: load the agreed state (after a failure),
        then keep what a later recovery needs (collective)."""
        if isinstance(self._restore, str):
            if hook is None or not hook.resume(strategy):
                if self.comm.rank == 0:
                    log.warning("no checkpoint to restore from: continuing from step 0")
        elif self._restore is not None:
            strategy.load_state_dict(self._restore)
        self._restore = None
        if self._pending is not None:
            if hook is not None:    # the next interval mark after the newest checkpoint on disk
                saved = hook.manager.steps()
                hook.checked_step = saved[-1] if saved else 0
            self._pending["resumed_from"] = strategy.step
            self._pending["steps_redone"] = max(0, self._pending.pop("completed") - strategy.step)
        self._holder = strategy
        if self._unwritten is not None and self._unwritten["step"] == strategy.step and self.comm.rank == 0:
            self._write_unwritten()
        self._unwritten = None
        if self.route == "neighbour":
            self._pair(strategy)
            self._snapshot(strategy)

    def step_done(self, record: dict) -> None:
        """Right after a step completes, before the checkpoint hook's collectives: its metrics
        line, which the new rank 0 writes if rank 0 dies before writing it."""
        self._record = record

    def after_step(self, strategy, record: dict | None = None) -> None:
        """After every completed step (record: its metrics line): keep this step's shard (zero,
        neighbour route) and close the record of a recovery at its first completed step."""
        self._record = record
        self._kills.after_step(strategy.step)
        if self.route == "neighbour":
            self._snapshot(strategy)
        if self._pending is not None:
            rec, self._pending = self._pending, None
            rec["seconds"] = round(time.perf_counter() - rec.pop("t_fail"), 3)
            rec["done_at"] = time.time()        # wall clock, to match with outside records
            self.recoveries.append(rec)
            if self.comm.rank == 0:
                log.warning("recovered: lost rank(s) %s after step %d; %d ranks now, continued from "
                            "step %d (%d steps redone, state from %s); first step done %.2f s after "
                            "the failure", ",".join(map(str, rec["lost_ranks"])), rec["step"],
                            rec["new_size"], rec["resumed_from"], rec["steps_redone"], rec["restored_from"],
                            rec["seconds"])

    def _write_unwritten(self) -> None:
        """Append the metrics line of the newest completed step unless the file has it."""
        append_step_if_missing(os.path.join(self._out_dir, "metrics.jsonl"), self._unwritten)

    # ------------------------------------------------------------------ recovery
    def _recover(self, t_fail: float) -> None:
        """Shrink (again, if another rank fails meanwhile) and agree on the state to load."""
        lost: list[int] = []
        # the steps this rank completed (a strategy's step moves only when a step is done)
        completed = -1 if self._holder is None else self._holder.step
        while True:
            self.comm, gone = ulfm.shrink(self.comm)
            lost += gone
            self._kills.in_recovery()
            setup_logging(self.comm.rank, self.comm.size)
            try:
                completed = max(self.comm.comm.allgather(completed))
                source = self._agree()
                records = self.comm.comm.allgather(self._record)
                break
            except Exception as exc:
                if ulfm.failure_of(exc) is None and not ulfm.broken(self.comm, wait=1.0):
                    raise
        self._restore = source
        # the newest step's metrics line, which a dead rank 0 may not have written
        self._unwritten = next((r for r in records if r is not None and r.get("step") == completed), None)
        rec = {"step": completed, "lost_ranks": sorted(lost), "new_size": self.comm.size,
               "restored_from": "checkpoint" if isinstance(source, str) else
               ("start" if source is None else self.route), "completed": completed, "t_fail": t_fail,
               **self._detail}
        if self._pending is not None:          # failed again before a step completed: one record
            rec["lost_ranks"] = sorted(self._pending["lost_ranks"] + rec["lost_ranks"])
            rec["t_fail"] = self._pending["t_fail"]
        self._pending = rec
        if self.comm.rank == 0:
            log.warning("lost rank(s) %s after step %d: continuing on %d ranks",
                        ",".join(map(str, rec["lost_ranks"])), completed, self.comm.size)

    def _agree(self):
        """Collective over the survivors: the state the rebuilt strategy loads."""
        if self.route == "checkpoint":
            return "checkpoint"
        if self.route == "neighbour":
            return self._assemble_shards()
        if self.route == "groups":
            return self._regroup()
        held = self._holder
        steps = self.comm.comm.allgather(-1 if held is None else held.step)
        best = max(steps)
        if best < 0:
            return None                  # failed before any strategy existed: start afresh
        mine = None if held is None or held.step != best else (
            held if isinstance(held, InMemoryState) else replica(held))
        if min(steps) != best:          # some survivors lag the step in flight: the donor's
            mine = self.comm.comm.bcast(mine, root=steps.index(best))
        self._holder = mine
        return mine

    # ------------------------------------------------------------------ diloco: groups
    def _regroup(self):
        """Collective over the survivors: this rank's state (engine.diloco.combine_replicas)
        from the newest outer sync and its group's newest inner state; None to start afresh."""
        held = self._holder
        mine = None if held is None else (held if isinstance(held, InMemoryState) else replica(held))
        c = self.comm.comm
        me = c.Get_rank()
        # 1. what every survivor holds: loop step, outer and inner versions, (group, groups)
        info = c.allgather(None if mine is None else
                           (mine.step, *replica_versions(mine), tuple(mine.scalars["diloco_group"])))
        self._groups, self._detail = None, {}
        if any(i is None for i in info):   # failed before every rank had a strategy: afresh
            self._holder = None
            return None
        steps, outer, inner, groups = zip(*info)
        # 2. theta_outer and its momentum of the newest sync, from the lowest rank holding it
        newest = mine if min(outer) == max(outer) else c.bcast(mine, root=outer.index(max(outer)))
        # 3. my group's newest inner state, from its lowest member holding it to those behind
        mates = [r for r in range(c.Get_size()) if groups[r][0] == groups[me][0]]
        donor = max(mates, key=lambda r: (inner[r], -r))
        if me == donor:
            MPI.Request.waitall([c.isend(mine, dest=r, tag=_REGROUP_TAG) for r in mates if inner[r] < inner[me]])
        elif inner[me] < inner[donor]:
            mine = c.recv(source=donor, tag=_REGROUP_TAG)
        # 4. the groups now: the survivors' own, numbered afresh; those left empty are dropped
        colors = group_colors([g for g, _ in groups], 0)
        count = max(colors) + 1
        self._groups = colors
        self._detail = {"groups": count,
                        "dropped_groups": sorted(set(range(groups[0][1])) - {g for g, _ in groups}),
                        "inner_steps": [max(k for k, c in zip(inner, colors) if c == g) for g in range(count)]}
        self._holder = combine_replicas(max(steps), newest, mine, [colors[me], count])
        return self._holder

    # ------------------------------------------------------------------ zero: neighbour copies
    def _pair(self, strategy) -> None:
        """With a new strategy: tell my right neighbour what my copies will hold (pieces and
        message size, fixed while the strategy lives) and learn the left one's, so that each
        step's copy travels as one raw message of agreed size (collective)."""
        sd = strategy.state_dict()
        pieces = describe(sd)
        self._index = (packed(sd, pieces).size, pieces)
        c = self.comm
        if c.size > 1:
            self._left = c.comm.sendrecv(self._index, dest=(c.rank + 1) % c.size,
                                         source=(c.rank - 1) % c.size)

    def _snapshot(self, strategy) -> None:
        """Keep my pieces of this step and swap copies with my neighbours: mine to the right,
        the left one's to me, in one Sendrecv (collective)."""
        sd = strategy.state_dict()
        raw = packed(sd, self._index[1])
        self._mine.append((sd.step, self._index, raw, dict(sd.scalars)))
        c = self.comm
        if c.size > 1:
            theirs = np.empty(self._left[0], dtype=np.uint8)
            c.comm.Sendrecv(raw, dest=(c.rank + 1) % c.size, recvbuf=theirs, source=(c.rank - 1) % c.size)
            # the step and the scalars are the same on every rank
            self._theirs.append((sd.step, self._left, theirs, dict(sd.scalars)))

    def _assemble_shards(self):
        """The newest step every piece of which some survivor holds, assembled whole on every
        rank (an InMemoryState); "checkpoint" when there is none (neighbours died together)."""
        held = list(self._mine) + list(self._theirs)
        # 1. what every survivor holds, and the newest step it covers
        everyone = self.comm.comm.allgather([(step, index, scalars) for step, index, _, scalars in held])
        steps = sorted({s for entries in everyone for s, _, _ in entries}, reverse=True)
        best = next((s for s in steps if pieces_cover([spans_of(index) for entries in everyone
                                                       for st, index, _ in entries if st == s])), None)
        if best is None:
            if self.comm.rank == 0:
                log.warning("the lost shards have no surviving copy: restoring from the last checkpoint")
            return "checkpoint"
        # 2. every copy of that step to every survivor, raw, in sizes known from step 1
        indexes = [[index for st, index, _ in entries if st == best] for entries in everyone]
        counts = [sum(index[0] for index in per_rank) for per_rank in indexes]
        sent = [raw for step, _, raw, _ in held if step == best]
        everything = np.empty(sum(counts), dtype=np.uint8)
        self.comm.comm.Allgatherv(np.concatenate(sent) if sent else np.empty(0, np.uint8), [everything, counts])
        # 3. the whole tensors from the pieces
        pieces, at = [], 0
        for index in (ix for per_rank in indexes for ix in per_rank):
            pieces.append(unpack(index, everything[at:at + index[0]]))
            at += index[0]
        scalars = next(sc for entries in everyone for st, _, sc in entries if st == best)
        return assemble_state(best, pieces, scalars)


def describe(sd) -> tuple:
    """The pieces of sd, keys sorted, as ((key, shape, offset, count, dtype), ...): what a
    copy holds; with its message size, the index of a copy, (bytes, pieces)."""
    return tuple((k, tuple(p.shape), p.offset, p.data.size, p.data.dtype.str)
                 for k, p in sorted(sd.tensors.items()))


def packed(sd, pieces: tuple) -> np.ndarray:
    """A copy of sd's pieces in the order describe() gave: one uint8 message (compress.wire)."""
    return wire.pack([sd.tensors[key].data for key, *_ in pieces])


def unpack(index: tuple, raw: np.ndarray) -> dict:
    """{key: TensorPiece} of a copy (views into raw, the message of that index)."""
    _, pieces = index
    arrays = wire.unpack(raw, [dt for *_, dt in pieces])
    return {k: TensorPiece(shape, off, a) for (k, shape, off, _, _), a in zip(pieces, arrays)}


def spans_of(index: tuple) -> dict:
    """{key: (shape, offset, count)} of a copy, as pieces_cover reads it."""
    return {k: (shape, off, count) for k, shape, off, count, _ in index[1]}


def pieces_cover(indexes: list[dict]) -> bool:
    """Do these pieces ({key: (shape, offset, count)} per holder) cover every tensor whole?"""
    spans: dict = {}
    for idx in indexes:
        for key, (shape, off, count) in idx.items():
            spans.setdefault(key, [int(np.prod(shape))]).append((off, off + count))
    if not spans:
        return False
    for numel, *parts in spans.values():
        reach = 0
        for lo, hi in sorted(parts):
            if lo > reach:
                return False
            reach = max(reach, hi)
        if reach < numel:
            return False
    return True


def replica(strategy) -> InMemoryState:
    """A strategy's whole state on this rank (its replica_state_dict: parameters, optimizer
    buffers and step of dp), which its load_state_dict reads at any world size. Local."""
    sd = strategy.replica_state_dict()
    return assemble_state(sd.step, [sd.tensors], sd.scalars)
