"""`mpidist bench guard`: what the mismatch guard and flight recorder add to each call.

Small allreduces (algorithm "native", so the algorithm itself is MPI_Allreduce) with the
guard on and off, and the bare `comm.Allreduce` of mpi4py for reference, alternated in
shuffled rounds of `--calls` calls each; the figure is the median over rounds of the
slowest rank's time per call. A mixed row ("8+1K") cycles through its sizes call by call,
as a training loop mixing small and larger calls does. Run it under mpiexec or the
launcher:

    python -m mpidist.launcher -n 2 -- mpidist bench guard

See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

from mpidist.collectives import allreduce, guard
from mpidist.collectives.tuning.timing import time_rounds
from mpidist.sizes import parse_sizes
from mpidist.comm import Communicator

__all__ = ["main", "measure"]


def measure(comm, sizes: list[int], calls: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of: the bare MPI_Allreduce, allreduce with the guard off, on;
    the calls cycle through sizes (bytes)."""
    xs = [np.zeros(max(1, n // 4), np.float32) for n in sizes]  # zeros: sums never overflow
    cycle = [xs[i % len(xs)] for i in range(calls)]
    mode = guard.get_mode()

    def batch(setting):
        def run():
            guard.set_mode(setting)
            for x in cycle:
                allreduce(x, algorithm="native", comm=comm)
        return run

    def bare():
        for x in cycle:
            comm.comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)

    variants = {"MPI_Allreduce": bare, "guard off": batch("off"), "guard on": batch("on")}
    try:
        for run in variants.values():
            run()                                   # warm-up
        times = time_rounds(comm, variants, rounds)
    finally:
        guard.set_mode(mode)
    return {k: float(np.median(t)) / calls for k, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code."""
    parser = argparse.ArgumentParser(prog="mpidist bench guard", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("8,1K"),
                        help="message sizes in bytes (default 8,1K)")
    parser.add_argument("--mixed", default="8+1K",
                        help="a row cycling through these sizes ('' for none; default 8+1K)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=15, help="rounds per variant")
    args = parser.parse_args(argv)
    comm = Communicator()
    cycles = [[n] for n in args.sizes]
    if args.mixed:
        cycles.append([parse_sizes(n)[0] for n in args.mixed.split("+")])
    rows = [("+".join(map(str, c)), measure(comm, c, args.calls, args.rounds)) for c in cycles]
    if comm.rank == 0:
        print(f"mismatch guard cost, {comm.size} ranks, {args.rounds} alternated rounds of "
              f"{args.calls} calls, median us per call (slowest rank)")
        print(f"{'bytes':>8} {'MPI_Allreduce':>14} {'guard off':>10} {'guard on':>10} {'guard cost':>11}")
        for nbytes, t in rows:
            us = {k: v * 1e6 for k, v in t.items()}
            print(f"{nbytes:>8} {us['MPI_Allreduce']:>14.2f} {us['guard off']:>10.2f} "
                  f"{us['guard on']:>10.2f} {us['guard on'] - us['guard off']:>11.2f}")
    comm.free()
    return 0
