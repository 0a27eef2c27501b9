"""On-line check of auto's choice: the cost model shortlists, a trial at the real size decides.

The model is fitted by a short probe at another moment than the calls it predicts, and on
a busy or oversubscribed machine its close calls go either way: at 16 MiB on 2 ranks it
put the ring 3% ahead of MPI_Allreduce, which then ran 13% faster; at 1 MiB on 4 ranks it
chose MPI_Allreduce, 2.9x slower than the shared-memory algorithm; at 256 KiB on 2 ranks
it predicted that algorithm, the fastest there, at 2.3x its time. So, as Intel MPI's
autotuner does within an application's own calls, the first auto call of each size class
times the model's shortlist on the call's own data before it runs:

    shortlist   the algorithms predicted within MARGIN of the model's best (at most
                SHORTLIST, best first)
    trials      one warm-up round (buffers, windows, caches), then up to ROUNDS timed
                rounds (fewer for large messages: about TRIAL_SECONDS in all by the
                model's predictions), each round every candidate once in a shuffled order
                (costmodel.round_order), each after a barrier, in place on a fresh copy
                of the call's input (core.trial_runner), which is left as it was; past
                TRIAL_BYTES on a copy of its first TRIAL_BYTES, which bounds the memory
    agreement   one MPI_Allreduce(MAX) of every candidate's median time: every rank keeps
                the same algorithm, the lowest; a one-entry shortlist needs no trial, and
                where some rank has no memory for the copy, all keep the model's choice

Later calls of the class look the pick up. Size classes are quarter octaves of the bytes
reduced. The trial runs inside the first call, which every rank makes at the same point,
so it is collective like the call itself; the trial state is per communicator. Every call
of a class, the first included, runs the pick, so within a process auto's results do not
change from call to call. A pick is also remembered with the model (CostModel.remember:
in its cache file, beside the fits that shortlisted it; a refit forgets it), and a tuner
starts from its communicator's first rank's remembered picks (one broadcast when it is
made), so a later process on the same layout runs the same algorithm with no trial and
repeats the earlier run's bits. Without that file a pick may differ between processes:
pin `algorithm` (the main job pins "ring") where runs at 3 or more ranks must be
bit-identical regardless.

MPIDIST_AUTOTUNE=0 turns the trials off: auto is then the model's choice alone.
"""
from __future__ import annotations

import math
import os
import threading
import weakref

import numpy as np
from mpi4py import MPI

from mpidist.collectives import costmodel

__all__ = ["Tuner", "tuner", "reset", "enabled", "size_class", "MARGIN", "SHORTLIST",
           "ROUNDS", "TRIAL_SECONDS", "TRIAL_BYTES"]

MARGIN = 3.0          # shortlist: predicted within this factor of the model's best
SHORTLIST = 5         # at most this many candidates
ROUNDS = 5            # timed rounds at most (after one warm-up round)
TRIAL_SECONDS = 0.5   # fewer rounds where the model predicts more time than this
TRIAL_BYTES = 256 << 20   # larger messages are tried on their first this many bytes


def enabled() -> bool:
    return os.environ.get("MPIDIST_AUTOTUNE", "1").strip().lower() not in ("0", "off", "false", "no")


def size_class(nbytes: int) -> int:
    """Quarter octaves: sizes within about 19% of each other share a trial and its pick."""
    return int(4 * math.log2(nbytes)) if nbytes > 0 else -1


class Tuner:
    """auto's picks on one communicator: per exact size (the fast path) and per class."""

    def __init__(self, comm):
        """Collective: MPIDIST_AUTOTUNE and the model's remembered picks as comm's first
        rank has them (a setting that differed between ranks would hang the trials)."""
        self.comm = comm
        self.decisions: dict[int, str] = {}        # nbytes -> pick: comm.auto_picks
        self.trials: dict[int, dict] = {}          # size class -> what its trial found
        model = costmodel.get_model(comm)
        on = enabled()
        self.enabled, remembered = comm.comm.bcast((on, dict(model.picks) if on else {}),
                                                   root=0)
        candidates = set(model.candidates())
        for key, pick in remembered.items():
            if pick in candidates:
                self.trials[key] = {"nbytes": None, "shortlist": [pick], "pick": pick,
                                    "model_pick": None, "median_s": {}, "rounds": 0,
                                    "remembered": True}

    def choose(self, nbytes: int, make_trial) -> str:
        """The algorithm auto runs for nbytes; the same on every rank. On the first call of
        a size class with a shortlist of several, make_trial() gives the function
        algorithm -> seconds (collective: core.trial_runner) that times the deciding rounds."""
        model = costmodel.get_model(self.comm)
        if model.levels["world"]["p"] == 1 or not self.enabled:
            pick = model.choose(nbytes)
        else:
            key = size_class(nbytes)
            found = self.trials.get(key)
            if found is None:
                found = self.trials[key] = self._trial(model, nbytes, key, make_trial)
                if self.comm.rank == 0 and found["rounds"]:
                    model.remember(key, found["pick"])
            pick = found["pick"]
        if len(self.decisions) < 4096:
            self.decisions[nbytes] = pick
        return pick

    def _trial(self, model, nbytes: int, key: int, make_trial) -> dict:
        predicted = sorted((model.predict(a, nbytes), k, a)
                           for k, a in enumerate(model.candidates()))
        best = predicted[0][0]
        shortlist = [a for t, _, a in predicted if t <= MARGIN * best or best <= 0][:SHORTLIST]
        found = {"nbytes": nbytes, "shortlist": shortlist, "pick": shortlist[0],
                 "model_pick": shortlist[0], "median_s": {}, "rounds": 0, "remembered": False}
        if len(shortlist) == 1:
            return found
        per_round = sum(max(t, 0.0) for t, _, a in predicted if a in shortlist)
        rounds = max(1, min(ROUNDS, int(TRIAL_SECONDS / per_round) if per_round > 0 else ROUNDS))
        try:
            trial = make_trial()            # a scratch copy of the message
        except MemoryError:
            trial = None
        if not self.comm.comm.allreduce(trial is not None, op=MPI.LAND):
            return found                    # no room on some rank: the model's choice
        times = np.empty((rounds, len(shortlist)))
        for r in range(1 + rounds):
            for j in costmodel.round_order(len(shortlist), r, key):
                seconds = trial(shortlist[j])
                if r:                           # round 0 only warms up
                    times[r - 1, j] = seconds
        medians = np.median(times, axis=0)
        self.comm.comm.Allreduce(MPI.IN_PLACE, medians, op=MPI.MAX)
        found.update(pick=shortlist[int(np.argmin(medians))], rounds=rounds,
                     median_s=dict(zip(shortlist, medians.tolist())))
        return found


_tuners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def tuner(comm) -> Tuner:
    """comm's tuner (made on first use, collectively: not under the lock, which another
    thread may need meanwhile); its decisions become comm.auto_picks, auto's fast path."""
    with _lock:
        t = _tuners.get(comm)
    if t is None:
        t = Tuner(comm)
        with _lock:
            t = _tuners.setdefault(comm, t)
            comm.auto_picks = t.decisions
    return t


def reset(comm) -> None:
    """Forget comm's trials and picks (after a new model is installed); on every rank."""
    with _lock:
        _tuners.pop(comm, None)
        vars(comm).pop("auto_picks", None)      # back to the empty class default
