"""The alpha-beta-gamma cost model that `mpidist tune` and `mpidist explain` consult.

T(algorithm, n bytes, p ranks) = a(p) alpha + b(p) n beta + g(p) n gamma, where a, b, g count
the algorithm's message steps, bytes moved and bytes reduced per rank (`coefficients`).
A short probe fits it per link level ("world", "intra" node, "inter" node): gamma is timed
directly, alpha and beta per algorithm (the MPI library's C collectives and mpidist's
Python-driven steps pay very different fixed costs) and per range between neighbouring
probe sizes ("pieces", since memory behaves differently in and out of the caches). Rank 0
broadcasts the fit, so every rank predicts the same. Models are cached as JSON under
~/.cache/mpidist/ (MPIDIST_CACHE_DIR), keyed by hosts, layout, MPI library and segment
size; delete the file (or pass refit) to probe again. See docs/ARCHITECTURE.md (tuning).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
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
from mpidist.collectives.ring import segment_bytes
from mpidist.collectives.tuning.fit import coefficients, fit_least_squares, fit_pieces
from mpidist.collectives.tuning.timing import (STATE_BYTES, STATE_TOLERANCE, machine_state,
                                             measure, measure_all, round_order, state_held,
                                             time_rounds)
from mpidist.ft import ulfm

__all__ = ["CostModel", "coefficients", "round_order", "time_rounds", "measure",
           "measure_all", "get_model", "install", "probe", "PROBE_SIZES", "cache_path",
           "machine_state", "state_held", "STATE_BYTES", "STATE_TOLERANCE"]

PROBE_SIZES = (8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20,
               64 << 20, 256 << 20)
PROBE_SECONDS = 10.0               # per level: larger sizes are left out past this
FLAT = ("ring", "tree", "dbtree", "recursive_doubling", "rabenseifner", "shm", "native")
PROBE_ATTEMPTS = 2                 # probes of a level when the first saw the state move


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


class CostModel:
    """Fitted levels: {"world"|"intra"|"inter": {"p", "gamma", "fits": {alg: [alpha, beta]},
    "pieces": {alg: [[upto, alpha, beta], ...]}, "samples": {alg: [[nbytes, seconds], ...]},
    "conditions": {...}}} plus the node shape (nodes, per_node). "pieces" (optional) wins
    over "fits": the first piece whose upto >= nbytes, the last one beyond."""

    def __init__(self, levels: dict, nodes: int, per_node: int):
        self.levels, self.nodes, self.per_node = levels, nodes, per_node
        self.path: str | None = None               # the cache file it was read from or written to

    def candidates(self) -> list[str]:
        """The algorithms the model can predict on this layout (shm never under ULFM)."""
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
        """The model as JSON-able data (what the cache file holds)."""
        return {"levels": self.levels, "nodes": self.nodes, "per_node": self.per_node}

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        """The model from to_json()'s data."""
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
        fits[alg] = list(fit_least_squares(alg, comm.size, gamma, sizes, times))
        pieces[alg] = fit_pieces(alg, comm.size, gamma, sizes, times)
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
