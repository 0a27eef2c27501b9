"""The alpha-beta-gamma cost model of the allreduce algorithms, fitted to this machine.

    python -m mpidist.launcher -n 4 -- python -m experiments.costmodel --sizes 4K,64K,1M,16M

T(algorithm, n bytes, p ranks) = a(p) alpha + b(p) n beta + g(p) n gamma, where a, b, g count
the algorithm's message steps, bytes moved and bytes reduced per rank (`coefficients`, as in
Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
MPICH", 2005). `probe` fits it per link level ("world", "intra" node, "inter" node): gamma
is timed directly, alpha and beta per algorithm (the MPI library's C collectives and
mpidist's Python-driven steps pay very different fixed costs) and per range between
neighbouring probe sizes ("pieces": memory behaves differently in and out of the caches).
Rank 0 broadcasts the fit, so every rank predicts the same.

mpidist itself does not use the model: `mpidist tune` writes auto's table from measurement
alone. The model stays here to show how far the textbook formulas explain the timings (run
as above: per size and algorithm, the prediction, the measurement and the error) and for
the architectures experiment, which sets the seed's formulas beside a fit on the cluster.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np
from mpi4py import MPI

from mpidist.collectives import node
from mpidist.collectives.tuning.timing import (machine_state, measure_all, round_order,
                                             state_held)

__all__ = ["CostModel", "coefficients", "fit_least_squares", "line_through", "fit_pieces",
           "probe", "round_order", "PROBE_SIZES", "FLAT"]

PROBE_SIZES = (8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20,
               64 << 20, 256 << 20)
PROBE_SECONDS = 10.0               # per level: larger sizes are left out past this
FLAT = ("ring", "tree", "dbtree", "recursive_doubling", "rabenseifner", "shm", "native")
PROBE_ATTEMPTS = 2                 # probes of a level when the first saw the state move


# ---------------------------------------------------------------------- formulas and fits
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


def fit_least_squares(algorithm: str, p: int, gamma: float, sizes, times) -> tuple[float, float]:
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


def line_through(algorithm: str, p: int, gamma: float, sizes, times) -> tuple[float, float]:
    """(alpha, beta) of the model line through two (bytes, seconds) points, of any sign."""
    a, b, g = coefficients(algorithm, p)
    (n0, n1), (t0, t1) = sizes, times
    r0, r1 = t0 - g * n0 * gamma, t1 - g * n1 * gamma
    beta = (r1 - r0) / (b * (n1 - n0))
    return (r0 - b * n0 * beta) / a, beta


def fit_pieces(algorithm: str, p: int, gamma: float, sizes, times) -> list[list[float]]:
    """[[upto, alpha, beta], ...]: per range between neighbouring probe sizes, the line
    through its two end points; upto is the range's upper end.

    Inside a range the line is exact at both ends and positive between them, whatever the
    signs of alpha and beta: a time that grows faster than the bytes (an MPI library that
    faults in a fresh buffer per call at large sizes) needs a negative alpha. The first and
    last lines also extend past the probe sizes; where the first would fall below zero for
    fewer bytes, a piece holding the first point's time goes before it, and where the last
    falls with more bytes, a piece proportional to the bytes through the last point goes
    after it."""
    a, b, g = coefficients(algorithm, p)
    pieces = [[sizes[i], *line_through(algorithm, p, gamma, sizes[i - 1:i + 1],
                                       times[i - 1:i + 1])]
              for i in range(1, len(sizes))]
    if pieces and pieces[0][1] < 0:
        pieces.insert(0, [sizes[0], max(0.0, times[0] - g * sizes[0] * gamma) / a, 0.0])
    if pieces and pieces[-1][2] < 0:
        per_byte = max(0.0, times[-1] - g * sizes[-1] * gamma) / (b * sizes[-1])
        pieces.append([sizes[-1], 0.0, per_byte])
    return pieces


# ---------------------------------------------------------------------- the model
class CostModel:
    """Fitted levels: {"world"|"intra"|"inter": {"p", "gamma", "fits": {alg: [alpha, beta]},
    "pieces": {alg: [[upto, alpha, beta], ...]}, "samples": {alg: [[nbytes, seconds], ...]},
    "conditions": {...}}} plus the node shape (nodes, per_node). "pieces" (optional) wins
    over "fits": the first piece whose upto >= nbytes, the last one beyond."""

    def __init__(self, levels: dict, nodes: int, per_node: int):
        self.levels, self.nodes, self.per_node = levels, nodes, per_node

    def candidates(self) -> list[str]:
        """The algorithms the model can predict on this layout (shm only where probed)."""
        names = [a for a in FLAT if a in self.levels["world"]["fits"]]
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
        """The model as JSON-able data."""
        return {"levels": self.levels, "nodes": self.nodes, "per_node": self.per_node}

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        """The model from to_json()'s data."""
        return cls(d["levels"], d["nodes"], d["per_node"])


# ---------------------------------------------------------------------- the probe
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
    by_size, t0, last = {}, time.perf_counter(), None
    for s in sorted(sizes):
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
        flat = [a for a in FLAT if a != "shm" or node.usable(comm)]
        levels["world"] = _probe_level(comm, flat, sizes, reps, seconds)
    hier = comm.uniform_nodes and comm.num_nodes > 1 and comm.local_size > 1
    if hier:
        intra = _probe_level(comm.node_comm, ["ring"], sizes, reps, seconds)
        inter = _probe_level(comm.inter_comm, ["ring"], sizes, reps, seconds)
        # every rank of a level measured the same thing; take rank 0's node and local index
        levels["intra"] = comm.comm.bcast(intra, root=0)
        levels["inter"] = comm.comm.bcast(inter, root=0)
    return CostModel(levels, comm.num_nodes, comm.local_size if hier else 1)


# ---------------------------------------------------------------------- showing it
def main(argv: list[str] | None = None) -> int:
    """Probe, then per size and algorithm: the prediction beside a fresh measurement."""
    from mpidist.comm import Communicator, mpi_library       # starts MPI: only when run
    from mpidist.sizes import format_size, parse_sizes
    ap = argparse.ArgumentParser(prog="python -m experiments.costmodel",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4K,64K,1M,16M", type=parse_sizes,
                    help="sizes to predict and measure (default 4K,64K,1M,16M)")
    ap.add_argument("--probe-sizes", default=None, type=parse_sizes,
                    help="sizes the fit is probed at (default: 8 B to 256 MiB, time-boxed)")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds per measured point")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="simulate nodes of this many ranks (default: real topology)")
    args = ap.parse_args(argv)
    c = Communicator(ranks_per_node=args.ranks_per_node)
    model = probe(c, sizes=args.probe_sizes or PROBE_SIZES)
    names = model.candidates() if c.size > 1 else ["native"]
    rows = [(n, a, model.predict(a, n), t)
            for n in args.sizes for a, t in measure_all(c, names, n, args.reps).items()]
    if c.rank == 0:
        print(f"# {mpi_library()}; {c.describe()}")
        for name, lv in model.levels.items():
            fits = ", ".join(f"{a} a={v[0] * 1e6:.1f}us b={v[1] * 1e9:.3f}ns/B"
                             for a, v in lv["fits"].items())
            print(f"# level {name}: p={lv['p']} gamma={lv['gamma'] * 1e9:.3f}ns/B; {fits} "
                  f"(least squares over all sizes; predictions use per-range pieces)")
        print(f"{'size':>8} {'algorithm':>19} {'predicted ms':>13} {'measured ms':>12} "
              f"{'error':>7}")
        for n, a, pred, t in rows:
            mark = "  <- model's choice" if a == model.choose(n) else ""
            print(f"{format_size(n):>8} {a:>19} {pred * 1e3:13.3f} {t * 1e3:12.3f} "
                  f"{(pred - t) / t:+7.0%}{mark}")
    c.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
