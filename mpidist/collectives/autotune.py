"""On-line check of auto's choice: the cost model shortlists, the first calls decide.

The model is fitted by a short probe at another moment than the calls it predicts, and on
a busy or oversubscribed machine its close calls go either way: at 16 MiB on 2 ranks it
put the ring 3% ahead of MPI_Allreduce, which then ran 13% faster; at 1 MiB on 4 ranks it
chose MPI_Allreduce, 2.9x slower than the shared-memory algorithm. So, as Intel MPI's
autotuner does within an application's own calls, auto tries the model's shortlist in the
first calls of each size class and keeps the fastest:

    shortlist   the algorithms predicted within MARGIN of the model's best (at most
                SHORTLIST, best first), at the first size met in the class
    trials      the next (1 + ROUNDS) * len(shortlist) calls of the class run the shortlist
                in rounds, each round in a shuffled order (costmodel.round_order); the
                first round warms buffers and windows up and is not counted; each trial
                starts after a barrier, and its time is recorded on this rank
    agreement   the last trial ends with one MPI_Allreduce(MAX) of every candidate's
                median time, so every rank keeps the same algorithm: the lowest
    settled     later calls of the class run it; a one-entry shortlist settles at once

Size classes are quarter octaves of the bytes reduced. Which algorithm a call runs depends
only on how many calls of its class the communicator has made, the same on every rank, so
the trials stay collective; the state is per communicator, never shared with another
communicator of the same layout. A call chosen before the agreement has finished (an
asynchronous call queued behind the trials) is resolved when it runs, after the agreement.

MPIDIST_AUTOTUNE=0 turns the trials off: auto is then the model's choice alone.
"""
from __future__ import annotations

import math
import os
import threading
import time
import weakref

import numpy as np
from mpi4py import MPI

from mpidist.collectives import costmodel

__all__ = ["Tuner", "Choice", "tuner", "last", "reset", "enabled", "MARGIN", "SHORTLIST",
           "ROUNDS"]

MARGIN = 2.0          # shortlist: predicted within this factor of the model's best
SHORTLIST = 3         # at most this many candidates
ROUNDS = 5            # counted trials per candidate (after one warm-up round)


def enabled() -> bool:
    return os.environ.get("MPIDIST_AUTOTUNE", "1").strip().lower() not in ("0", "off", "false", "no")


def size_class(nbytes: int) -> int:
    """Quarter octaves: sizes within about 19% of each other share trials and the pick."""
    return int(4 * math.log2(nbytes)) if nbytes > 0 else -1


class _Class:
    """The trials of one size class."""

    def __init__(self, shortlist: list[str]):
        self.shortlist = shortlist
        self.trials = (1 + ROUNDS) * len(shortlist) if len(shortlist) > 1 else 0
        self.handed = 0                            # calls chosen so far
        self.reported = 0                          # trials that have run
        self.samples: dict[str, list[float]] = {a: [] for a in shortlist}
        self.pick: str | None = None if self.trials else shortlist[0]
        self.failed = False


class Choice(str):
    """The algorithm name auto hands out while a size class is being tried: a trial (its
    run is timed and reported) or a call queued behind the trials (resolved at run time).
    Everything that only needs the name treats it as the str it is."""

    def __new__(cls, name: str, tuner: "Tuner", cls_state: _Class, index: int):
        self = super().__new__(cls, name)
        self.tuner, self.state, self.index = tuner, cls_state, index
        return self

    def run(self, comm, fn) -> None:
        """fn(algorithm) on comm (the communicator the call runs on), timed if a trial."""
        self.tuner.run(self, comm, fn)


class Tuner:
    """auto's state for one communicator: the settled picks and the classes on trial."""

    def __init__(self, comm):
        self.comm = comm
        self.decisions: dict[int, str] = {}        # nbytes -> settled pick: the fast path
        self._classes: dict[int, _Class] = {}
        self._cond = threading.Condition()
        self.enabled = enabled()

    def choose(self, nbytes: int) -> str:
        """The algorithm the next call of nbytes runs: a plain name once settled, else a
        Choice. Every rank gets the same answer for the same call."""
        model = costmodel.get_model(self.comm)
        if model.levels["world"]["p"] == 1:
            return "native"
        if not self.enabled:
            return model.choose(nbytes)
        with self._cond:
            key = size_class(nbytes)
            state = self._classes.get(key)
            if state is None:
                state = self._classes[key] = _Class(self._shortlist(model, nbytes))
            if state.pick is not None:
                if len(self.decisions) < 4096:
                    self.decisions[nbytes] = state.pick
                return state.pick
            i = state.handed
            state.handed += 1
            k = len(state.shortlist)
            name = state.shortlist[costmodel.round_order(k, i // k, key)[i % k]] \
                if i < state.trials else state.shortlist[0]
            return Choice(name, self, state, i)

    @staticmethod
    def _shortlist(model, nbytes: int) -> list[str]:
        predicted = sorted((model.predict(a, nbytes), k, a)
                           for k, a in enumerate(model.candidates()))
        best = predicted[0][0]
        return [a for t, _, a in predicted if t <= MARGIN * best or best <= 0][:SHORTLIST]

    def run(self, choice: Choice, comm, fn) -> None:
        state = choice.state
        if choice.index >= state.trials:                  # queued behind the trials
            with self._cond:
                self._cond.wait_for(lambda: state.pick is not None)
            fn(state.pick)
            return
        comm.comm.Barrier()            # time the algorithm, not the ranks' arrival skew
        t0 = time.perf_counter()
        try:
            fn(str(choice))
        except BaseException:
            with self._cond:
                state.failed = True
                state.reported += 1
                self._cond.notify_all()
            raise
        seconds = time.perf_counter() - t0
        with self._cond:
            if choice.index >= len(state.shortlist):      # round 0 only warms up
                state.samples[str(choice)].append(seconds)
            state.reported += 1
            self._cond.notify_all()
            if choice.index != state.trials - 1:
                return
            self._cond.wait_for(lambda: state.reported == state.trials)
            medians = np.array([np.median(state.samples[a]) for a in state.shortlist])
            failed = state.failed
        if failed:                     # the trials broke: settle on the model's choice
            pick = state.shortlist[0]
        else:                          # the agreement: the slowest rank's view of each
            comm.comm.Allreduce(MPI.IN_PLACE, medians, op=MPI.MAX)
            pick = state.shortlist[int(np.argmin(medians))]
        with self._cond:
            state.pick = pick
            self._cond.notify_all()

    def summary(self) -> dict[int, dict]:
        """{size class: {"shortlist", "pick", "median_s"}} of the classes met so far."""
        with self._cond:
            return {k: {"shortlist": list(s.shortlist), "pick": s.pick,
                        "median_s": {a: float(np.median(v)) if v else None
                                     for a, v in s.samples.items()}}
                    for k, s in self._classes.items()}

    def calls_to_settle(self, nbytes: int) -> int:
        """How many more calls of nbytes's class until it runs its pick (0 once settled
        or not yet met and settling at once); the same on every rank."""
        with self._cond:
            state = self._classes.get(size_class(nbytes))
            if state is None:
                return self._settle_calls(nbytes)
            return max(0, state.trials - state.handed)

    def _settle_calls(self, nbytes: int) -> int:
        model = costmodel.get_model(self.comm)
        if not self.enabled or model.levels["world"]["p"] == 1:
            return 0
        k = len(self._shortlist(model, nbytes))
        return (1 + ROUNDS) * k if k > 1 else 0


_tuners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_last: tuple = (None, None)


def tuner(comm) -> Tuner:
    """comm's tuner (made on first use; the model behind it is collective on first use)."""
    global _last
    with _lock:
        t = _tuners.get(comm)
        if t is None:
            t = _tuners[comm] = Tuner(comm)
        _last = (comm, t)
    return t


def last() -> tuple:
    """(communicator, tuner) of the last tuner() call: the fast path of "auto"."""
    return _last


def reset(comm) -> None:
    """Forget comm's trials and picks (after a new model is installed); on every rank."""
    global _last
    with _lock:
        _tuners.pop(comm, None)
        if _last[0] is comm:
            _last = (None, None)
