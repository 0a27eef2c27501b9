"""Timing allreduce calls the way the tuner and the benchmark both do.

Every call goes through the public allreduce(); the calls run in interleaved rounds in an
order shuffled per round (the same on every rank), each after a barrier, and a point is the
slowest rank's time, so every rank holds the same numbers. machine_state is the reference
that tells whether two timings were taken on the same machine (cache-to-cache speed between
the ranks moves on a shared host). See docs/ARCHITECTURE.md (collectives, tuning).
"""
from __future__ import annotations

import random
import time

import numpy as np
from mpi4py import MPI

from mpidist.collectives.core import allreduce

__all__ = ["round_order", "time_rounds", "time_calls", "time_algorithms", "measure_all",
           "measure", "machine_state", "state_held", "STATE_BYTES", "STATE_TOLERANCE"]

STATE_BYTES = 256 << 10            # the machine_state reference: in the caches, between ranks
STATE_TOLERANCE = 1.25             # a larger move of machine_state: another machine


def round_order(m: int, round_index: int, seed: int) -> list[int]:
    """The order in which m timed calls run in one round: a permutation shuffled by
    (seed, round), the same on every rank that passes the same seed."""
    order = list(range(m))
    random.Random(seed * 1_000_003 + round_index).shuffle(order)
    return order


def time_rounds(comm, calls: dict, reps: int, *, seed: int = 0, setup=None) -> dict:
    """{name: seconds per round (array of reps)}: each round runs every call once, in the
    round_order of that round, each after a barrier, and keeps the slowest rank's time.
    Shuffled rounds mean no call is always timed right after another (a call right after
    the shared-memory algorithm runs slower, for one) and a burst of load hits all alike.
    setup(), if given, runs before each call, untimed."""
    names = list(calls)
    times = np.empty((reps, len(names)))
    for i in range(reps):
        for j in round_order(len(names), i, seed):
            if setup is not None:
                setup()
            comm.comm.Barrier()
            t0 = time.perf_counter()
            calls[names[j]]()
            times[i, j] = time.perf_counter() - t0
    comm.comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    return {a: times[:, j] for j, a in enumerate(names)}


def time_calls(comm, calls: dict, *, reps: int | None = None, seconds: float = 1.0,
               min_reps: int = 5, max_reps: int = 300, seed: int = 0, setup=None,
               warmed=None) -> dict[str, np.ndarray]:
    """{name: the slowest rank's seconds per round} for calls, after one warm-up call each
    (scratch, windows; warmed(name) runs after it, e.g. to check a result): time_rounds of
    reps rounds, or (reps None) as many as fit in `seconds` in all, within [min_reps,
    max_reps], as a second, warm call of each says (min_reps where the first calls already
    took longer), judged by the slowest rank so that every rank runs as many. setup() runs
    before every call, untimed. The one timing loop of the tuner and the bench."""
    t0 = time.perf_counter()
    for name, call in calls.items():
        if setup is not None:
            setup()
        call()
        if warmed is not None:
            warmed(name)
    if reps is None:
        first = comm.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        reps = min_reps
        if first * min_reps < seconds:    # more may fit: a second, warm call each says
            t0 = time.perf_counter()
            for call in calls.values():
                if setup is not None:
                    setup()
                call()
            warm = comm.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            reps = max(min_reps, min(max_reps, int(seconds / max(warm, 1e-9))))
    return time_rounds(comm, calls, reps, seed=seed, setup=setup)


def time_algorithms(comm, algorithms, nbytes: int, *, reps: int | None = None,
                    seconds: float = 1.0, min_reps: int = 5, max_reps: int = 300,
                    seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """time_calls of one public allreduce() of nbytes per algorithm, on one buffer refilled
    before each call."""
    x = np.ones(max(1, nbytes // np.dtype(dtype).itemsize), dtype)
    calls = {a: (lambda a=a: allreduce(x, algorithm=a, comm=comm)) for a in algorithms}
    return time_calls(comm, calls, reps=reps, seconds=seconds, min_reps=min_reps,
                      max_reps=max_reps, seed=seed, setup=lambda: x.fill(1))


def measure_all(comm, algorithms, nbytes: int, reps: int = 3, dtype=np.float32,
                seed: int = 0) -> dict[str, float]:
    """Median over reps rounds of time_algorithms, per algorithm."""
    times = time_algorithms(comm, algorithms, nbytes, reps=reps, seed=seed, dtype=dtype)
    return {a: float(np.median(t)) for a, t in times.items()}


def measure(comm, algorithm: str, nbytes: int, reps: int = 3, dtype=np.float32) -> float:
    """measure_all for one algorithm."""
    return measure_all(comm, [algorithm], nbytes, reps, dtype)[algorithm]


def machine_state(comm: MPI.Comm, reps: int = 15) -> float:
    """Collective: seconds of one MPI_Allreduce of STATE_BYTES (median of reps, each after a
    barrier, slowest rank), the same on every rank.

    How fast data moves between the ranks' caches right now. On a shared VM this can change
    by a few times within seconds while memory bandwidth does not (docs/PERFORMANCE.md), and
    every timing of sizes that live in the caches moves with it. A benchmark samples it
    around its figures, so a reader can tell whether two of them were taken on the same
    machine."""
    x = np.ones(STATE_BYTES // 4, np.float32)
    times = np.empty(reps)
    for i in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
        times[i] = time.perf_counter() - t0
    comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    return float(np.median(times))


def state_held(samples) -> bool:
    """Whether machine_state samples stayed within STATE_TOLERANCE of one another."""
    return max(samples) <= STATE_TOLERANCE * min(samples)
