"""The alpha-beta-gamma cost model that `mpidist tune` and `mpidist explain` consult.

T(algorithm, n bytes, p ranks) = a(p) alpha + b(p) n beta + g(p) n gamma, where a, b, g count
the algorithm's message steps, bytes moved and bytes reduced per rank (written next to
each algorithm in its module), alpha is the cost of a message step, beta of a byte moved
and gamma of a byte reduced.

Fitted per link level by a short probe: "world" is the communicator itself, "intra" its
node communicator and "inter" the communicator across nodes. gamma is timed directly (an
in-place ufunc over a buffer larger than the caches). alpha and beta are fitted per
algorithm, because the MPI library's C collectives and mpidist's Python-driven steps pay
very different fixed costs per step, and per size range, because memory behaves
differently in and out of the caches: the probe times the sizes the model is used at
(PROBE_SIZES, the benchmark's sweep) and each range between two neighbouring probe sizes
gets its own (alpha, beta) through its two end points ("pieces", see _pieces; below the
first and past the last size the nearest piece extends). "fits" holds one least-squares
fit over all sizes, for display. The native MPI_Allreduce, whose internal algorithm is the
library's choice, is modelled as one step moving n. The hierarchical algorithm is
predicted by composing the ring's intra-node and inter-node fits. The shared-memory
algorithm is a candidate only on a communicator within one node.

Timings are taken the way the benchmark takes them (`time_rounds`): every call goes
through the public allreduce(), the algorithms run in interleaved rounds in an order
shuffled per round (the same on every rank), and a point is the median over rounds of the
slowest rank's time. The probe stops at the first size that would run it past
PROBE_SECONDS per level; the sizes probed, the load average and the time taken are stored
with the model ("conditions"). Rank 0 broadcasts the fitted model, so every rank holds the
same numbers and makes the same predictions. Models are cached as JSON
under ~/.cache/mpidist/ (env MPIDIST_CACHE_DIR), keyed by the hosts, the rank layout, the
MPI library and the segment size; delete the file (or pass refit) to probe again.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import socket
import tempfile
import threading
import time
import warnings
import weakref

import numpy as np
from mpi4py import MPI

import mpidist
from mpidist.collectives import shm
from mpidist.collectives.core import allreduce
from mpidist.collectives.ring import segment_bytes
from mpidist.ft import ulfm

__all__ = ["CostModel", "coefficients", "round_order", "time_rounds", "measure",
           "measure_all", "get_model", "install", "probe", "PROBE_SIZES", "cache_path",
           "machine_state", "state_held", "STATE_BYTES", "STATE_TOLERANCE"]

PROBE_SIZES = (8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20,
               64 << 20, 256 << 20)
PROBE_SECONDS = 10.0               # per level: larger sizes are left out past this
FLAT = ("ring", "tree", "dbtree", "recursive_doubling", "rabenseifner", "shm", "native")
STATE_BYTES = 256 << 10            # the machine_state reference: in the caches, between ranks
STATE_TOLERANCE = 1.25             # a larger move of machine_state: another machine (25%: the
                                   # model's own error target)
PROBE_ATTEMPTS = 2                 # probes of a level when the first saw the state move


def _log2(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


def coefficients(algorithm: str, p: int) -> tuple[float, float, float]:
    """(a, b, g): message steps, bytes moved per byte of input, bytes reduced per byte."""
    if p == 1:
        return 0.0, 0.0, 0.0
    lg = _log2(p)
    p2 = 1 << (p.bit_length() - 1)
    lg2, fold = p2.bit_length() - 1, float(p != p2)
    if algorithm in ("ring", "hierarchical"):
        return 2 * (p - 1), 2 * (p - 1) / p, (p - 1) / p
    if algorithm == "tree":
        return 2 * lg - 1, 2 * lg, lg
    if algorithm == "dbtree":
        return 2 * lg, 2.0, 1.0
    if algorithm == "recursive_doubling":
        return lg2 + 2 * fold, lg2 + 2 * fold, lg2 + fold
    if algorithm == "rabenseifner":
        return 2 * lg2 + 2 * fold, 2 * (p2 - 1) / p2 + 2 * fold, (p2 - 1) / p2 + fold
    if algorithm == "shm":
        return 3.0, 2.0, 1.0
    if algorithm == "native":
        return 1.0, 1.0, 0.0
    raise ValueError(f"no cost formula for algorithm {algorithm!r}")


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


def measure_all(comm, algorithms, nbytes: int, reps: int = 3, dtype=np.float32,
                seed: int = 0) -> dict[str, float]:
    """Median over reps interleaved rounds (time_rounds) of the slowest rank's seconds for
    one public allreduce() of nbytes, per algorithm, after one warm-up call each."""
    x = np.ones(max(1, nbytes // np.dtype(dtype).itemsize), dtype)
    calls = {a: (lambda a=a: allreduce(x, algorithm=a, comm=comm)) for a in algorithms}
    for call in calls.values():
        call()                                           # warm-up: scratch, windows
    times = time_rounds(comm, calls, reps, seed=seed, setup=lambda: x.fill(1))
    return {a: float(np.median(t)) for a, t in times.items()}


def measure(comm, algorithm: str, nbytes: int, reps: int = 3, dtype=np.float32) -> float:
    """measure_all for one algorithm."""
    return measure_all(comm, [algorithm], nbytes, reps, dtype)[algorithm]


def machine_state(comm: MPI.Comm, reps: int = 15) -> float:
    """Collective: seconds of one MPI_Allreduce of STATE_BYTES (median of reps, each after a
    barrier, slowest rank), the same on every rank.

    How fast data moves between the ranks' caches right now. On a VM this can change by
    2-3x within seconds while memory bandwidth does not (here this reference took 55 or
    155 us, and MPI_Allreduce of 1 MiB 113 or 376 us, with a 32 MiB copy unchanged): every
    time the model holds for sizes that live in the caches moves with it. The probe
    stores it with the model, so a later run can tell whether it measures the machine
    the model was fitted on."""
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


def _reps(nbytes: int) -> int:
    """Probe repetitions: more where a run is cheap and noisy."""
    return 31 if nbytes <= (256 << 10) else 15 if nbytes <= (16 << 20) else 5


def _time_gamma(comm) -> float:
    """Seconds per byte of an in-place float32 add over 8 MiB (slowest rank)."""
    a = np.ones(2 << 20, np.float32)
    b = np.ones_like(a)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        np.add(a, b, out=a)
        best = min(best, time.perf_counter() - t0)
    return comm.comm.allreduce(best / a.nbytes, op=MPI.MAX)


def _fit(algorithm: str, p: int, gamma: float, sizes, times) -> tuple[float, float]:
    """Least-squares (alpha, beta) >= 0 minimising the relative error of the model."""
    a, b, g = coefficients(algorithm, p)
    t = np.asarray(times, float)
    n = np.asarray(sizes, float)
    rhs = (t - g * n * gamma) / t
    cols = np.stack([np.full_like(n, a) / t, b * n / t], axis=1)
    sol = np.linalg.lstsq(cols, rhs, rcond=None)[0]
    if sol.min() < 0:           # drop the negative term and refit the other alone
        keep = int(np.argmax(sol))
        col = cols[:, keep]
        sol = np.zeros(2)
        sol[keep] = max(0.0, float(col @ rhs / (col @ col)))
    return float(sol[0]), float(sol[1])


def _through(algorithm: str, p: int, gamma: float, sizes, times) -> tuple[float, float]:
    """(alpha, beta) of the model line through two (bytes, seconds) points, of any sign."""
    a, b, g = coefficients(algorithm, p)
    (n0, n1), (t0, t1) = sizes, times
    r0, r1 = t0 - g * n0 * gamma, t1 - g * n1 * gamma
    beta = (r1 - r0) / (b * (n1 - n0))
    return (r0 - b * n0 * beta) / a, beta


def _pieces(algorithm: str, p: int, gamma: float, sizes, times) -> list[list[float]]:
    """[[upto, alpha, beta], ...]: per range between neighbouring probe sizes, the line
    through its two end points; upto is the range's upper end.

    Inside a range the line is exact at both ends and positive between them, whatever the
    signs of alpha and beta: a time that grows faster than the bytes (the MPI library's
    allreduce of 64 MiB took 12x its 16 MiB time here, faulting in a fresh 32 MiB buffer
    per call) needs a negative alpha. The first and last lines also extend past the probe
    sizes; where the first would fall below zero for fewer bytes, a piece holding the
    first point's time goes before it, and where the last falls with more bytes, a piece
    proportional to the bytes through the last point goes after it."""
    a, b, g = coefficients(algorithm, p)
    pieces = [[sizes[i], *_through(algorithm, p, gamma, sizes[i - 1:i + 1], times[i - 1:i + 1])]
              for i in range(1, len(sizes))]
    if pieces and pieces[0][1] < 0:
        pieces.insert(0, [sizes[0], max(0.0, times[0] - g * sizes[0] * gamma) / a, 0.0])
    if pieces and pieces[-1][2] < 0:
        per_byte = max(0.0, times[-1] - g * sizes[-1] * gamma) / (b * sizes[-1])
        pieces.append([sizes[-1], 0.0, per_byte])
    return pieces


class CostModel:
    """Fitted levels: {"world"|"intra"|"inter": {"p", "gamma", "fits": {alg: [alpha, beta]},
    "pieces": {alg: [[upto, alpha, beta], ...]}, "samples": {alg: [[nbytes, seconds], ...]},
    "conditions": {...}}} plus the node shape (nodes, per_node). "pieces" (optional) wins
    over "fits": the first piece whose upto >= nbytes, the last one beyond."""

    def __init__(self, levels: dict, nodes: int, per_node: int):
        self.levels, self.nodes, self.per_node = levels, nodes, per_node
        self.path: str | None = None               # the cache file it was read from or written to

    def candidates(self) -> list[str]:
        names = [a for a in FLAT if a in self.levels["world"]["fits"]]
        if ulfm.active():            # a model probed without fault tolerance may list shm
            names = [a for a in names if a != "shm"]
        if "intra" in self.levels and "inter" in self.levels:
            names.append("hierarchical")
        return names

    def _level(self, level: str, algorithm: str, nbytes: float) -> float:
        lv = self.levels[level]
        pieces = lv.get("pieces", {}).get(algorithm)
        if pieces:
            alpha, beta = next((pc[1:] for pc in pieces if nbytes <= pc[0]), pieces[-1][1:])
        else:
            alpha, beta = lv["fits"][algorithm]
        a, b, g = coefficients(algorithm, lv["p"])
        return a * alpha + b * nbytes * beta + g * nbytes * lv["gamma"]

    def predict(self, algorithm: str, nbytes: int) -> float:
        """Predicted seconds for one allreduce of nbytes."""
        if self.levels["world"]["p"] == 1:
            return 0.0
        if algorithm == "hierarchical" and "hierarchical" in self.candidates():
            intra = self._level("intra", "ring", nbytes)   # reduce-scatter + allgather
            return intra + self._level("inter", "ring", nbytes / self.per_node)
        if algorithm == "hierarchical":
            algorithm = "ring"                             # what it falls back to
        return self._level("world", algorithm, nbytes)

    def choose(self, nbytes: int) -> str:
        """The cheapest candidate by prediction (ties: the earlier one in candidates())."""
        if self.levels["world"]["p"] == 1:
            return "native"
        return min(self.candidates(), key=lambda a: self.predict(a, nbytes))

    def to_json(self) -> dict:
        return {"levels": self.levels, "nodes": self.nodes, "per_node": self.per_node}

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        return cls(d["levels"], d["nodes"], d["per_node"])


def _probe_level(comm, algorithms, sizes, reps: int | None, seconds: float) -> dict:
    """Time every algorithm at the sizes (ascending), leaving out the larger ones once the
    next would run past `seconds` (judged by the slowest rank, so all ranks agree).

    machine_state is sampled before the first size and after each one; where it moved by
    more than STATE_TOLERANCE the timings mix two machines, and the level is probed once
    more (the steadier attempt is kept; conditions say whether it was steady)."""
    attempts = []
    for _ in range(PROBE_ATTEMPTS):
        level = _probe_level_once(comm, algorithms, sizes, reps, seconds)
        steady = level["conditions"]["state_steady"] = state_held(level["conditions"]["state_s"])
        attempts.append(level)
        if steady:
            break
    return min(attempts, key=lambda lv: max(lv["conditions"]["state_s"])
               / min(lv["conditions"]["state_s"]))


def _probe_level_once(comm, algorithms, sizes, reps: int | None, seconds: float) -> dict:
    load = os.getloadavg()[0]
    states = [machine_state(comm.comm)]
    gamma = _time_gamma(comm)
    sizes = sorted(sizes)
    by_size, t0, last = {}, time.perf_counter(), None
    for s in sizes:
        if last is not None:
            clock = np.array([time.perf_counter() - t0, last[1]])
            comm.comm.Allreduce(MPI.IN_PLACE, clock, MPI.MAX)
            spent, cost = clock
            if len(by_size) >= 2 and spent + cost * s / last[0] > seconds:
                break
        t1 = time.perf_counter()
        by_size[s] = measure_all(comm, algorithms, s, reps or _reps(s), seed=len(by_size))
        last = (s, time.perf_counter() - t1)
        states.append(machine_state(comm.comm))
    sizes = sorted(by_size)
    fits, pieces, samples = {}, {}, {}
    for alg in algorithms:
        times = [by_size[s][alg] for s in sizes]
        samples[alg] = [[s, t] for s, t in zip(sizes, times)]
        fits[alg] = list(_fit(alg, comm.size, gamma, sizes, times))
        pieces[alg] = _pieces(alg, comm.size, gamma, sizes, times)
    conditions = {"sizes": sizes, "seconds": round(time.perf_counter() - t0, 2),
                  "state_s": states, "load_before": load, "load_after": os.getloadavg()[0],
                  "cores": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    conditions = comm.comm.bcast(conditions, root=0)        # rank 0's clock and load
    return {"p": comm.size, "gamma": gamma, "fits": fits, "pieces": pieces,
            "samples": samples, "conditions": conditions}


def probe(comm, sizes=PROBE_SIZES, reps: int | None = None,
          seconds: float = PROBE_SECONDS) -> CostModel:
    """Collective: time every algorithm on comm (and the ring per link level) and fit;
    at most about `seconds` per level (larger sizes are then extrapolated)."""
    levels = {"world": {"p": 1, "gamma": 0.0, "fits": {}, "samples": {}}}
    if comm.size > 1:
        flat = [a for a in FLAT if a != "shm" or shm.usable(comm)]
        levels["world"] = _probe_level(comm, flat, sizes, reps, seconds)
    hier = comm.uniform_nodes and comm.num_nodes > 1 and comm.local_size > 1
    if hier:
        intra = _probe_level(comm.node_comm, ["ring"], sizes, reps, seconds)
        inter = _probe_level(comm.inter_comm, ["ring"], sizes, reps, seconds)
        # every rank of a level measured the same thing; take rank 0's node and local index
        levels["intra"] = comm.comm.bcast(intra, root=0)
        levels["inter"] = comm.comm.bcast(inter, root=0)
    return CostModel(levels, comm.num_nodes, comm.local_size if hier else 1)


def cache_path(comm) -> str:
    """The JSON file for comm's layout on these hosts with this MPI library."""
    hosts = sorted(set(comm.comm.allgather(socket.gethostname())))
    ident = json.dumps([hosts, comm.size, getattr(comm, "node_sizes", [comm.size]),
                        MPI.Get_library_version().strip().splitlines()[0], mpidist.__version__,
                        segment_bytes(), PROBE_SIZES, "pieces through probe points",
                        "tree top exchange"])
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    root = os.environ.get("MPIDIST_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "mpidist")
    return os.path.join(root, f"costmodel-{key}.json")


_models: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_by_path: dict[str, CostModel] = {}
_lock = threading.Lock()
_last: tuple = (None, None)        # the communicator asked last, and its model


def get_model(comm, refit: bool = False) -> CostModel:
    """Collective on first use per communicator: the cached model, loaded or probed."""
    global _last
    last = _last
    if not refit and last[0] is comm:
        return last[1]
    model = None if refit else _models.get(comm)
    if model is not None:
        _last = (comm, model)
        return model
    path = cache_path(comm)
    data = None
    if comm.rank == 0 and not refit:
        data = _by_path[path].to_json() if path in _by_path else _read(path)
    data = comm.comm.bcast(data, root=0)
    if data is None:
        data = comm.comm.bcast(probe(comm).to_json(), root=0)
        if comm.rank == 0:
            _write(path, data)
    model = CostModel.from_json(data)
    model.path = path
    with _lock:
        _models[comm] = model
        _by_path[path] = model
    _last = (comm, model)
    return model


def install(comm, model: CostModel) -> None:
    """Make `model` the one get_model returns for comm in this process (the cache file is
    left alone); every rank must install the same model."""
    global _last
    with _lock:
        _models[comm] = model
    _last = (comm, model)


def _read(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write(path: str, data: dict) -> None:
    """Atomic: a temporary file renamed into place (a failure only costs a later re-probe)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        warnings.warn(f"could not cache the allreduce cost model at {path}: {exc}; "
                      f"it will be probed again next time", RuntimeWarning, stacklevel=3)
