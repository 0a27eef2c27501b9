"""`mpidist info | train | bench | tune | explain | run`: the command-line entry points.

Subcommands import their modules lazily, so `mpidist run` starts mpiexec without
initialising MPI itself, and `mpidist --help` is instant.
See docs/ARCHITECTURE.md (benchmarks and CLI).
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import platform
import sys
import traceback

import mpidist
import mpidist.bench
from mpidist import threads
from mpidist.errors import abort_job
from mpidist.launcher import main as launch
from mpidist.launcher import unwired_launch

__all__ = ["main", "info"]

_DISPATCH = {
    "train": ("mpidist.engine.train", "run a training job from a TOML config: mpidist train CONFIG"),
    "tune": ("mpidist.collectives.tuning.tune", "time the allreduce algorithms, write auto's decision table"),
    "explain": ("mpidist.collectives.tuning.explain", "auto's allreduce algorithm per size and the table row or rule behind it"),
    "doctor": ("mpidist.doctor", "check this launch: one job, MPI library, threads, placement, GPUs, HDF5"),
}


def info(argv: list[str] | None = None) -> int:
    """Print what this MPI job has: MPI library, ranks, nodes, CUDA-awareness, h5py, Numba, CuPy."""
    parser = argparse.ArgumentParser(prog="mpidist info")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="simulate nodes of this many ranks (else MPIDIST_RANKS_PER_NODE)")
    args = parser.parse_args(argv)
    # here, not at the top: `from mpi4py import MPI` initialises MPI, which `mpidist run`
    # must not do before it starts mpiexec, and these are slow for `mpidist --help`
    from mpi4py import MPI
    from mpidist.collectives import select
    from mpidist import mpilib
    from mpidist.comm import Communicator, mpi_library
    from mpidist.h5 import parallel_hdf5
    from mpidist.kernels.backend import cupy_available, gpu_available

    comm = Communicator(ranks_per_node=args.ranks_per_node)
    hosts = comm.comm.gather(MPI.Get_processor_name(), root=0)
    if comm.rank == 0:
        import h5py                 # slow to import, as above
        import numba
        import numpy
        rows = [
            ("mpidist", mpidist.__version__),
            ("MPI library", mpi_library()),
            ("MPI family / ABI", f"{mpilib.family()} / {mpilib.abi()}"
                                 + (f" ({mpilib.path()})" if mpilib.path() else "")),
            ("MPI standard", "%d.%d" % MPI.Get_version()),
            ("mpi4py", __import__("mpi4py").__version__),
            ("ranks", str(comm.size)),
            ("hosts", ", ".join(sorted(set(hosts)))),
            ("nodes", comm.describe()),
            ("CUDA-aware MPI", "yes" if comm.cuda_aware else "no (CuPy buffers staged through host)"),
            ("h5py", f"{h5py.__version__}, HDF5 {h5py.version.hdf5_version}, MPI-IO "
                     + ("yes" if parallel_hdf5() else "no (checkpoints written by the ranks in "
                                                       "turns; HDF5_MPI=ON builds parallel)")),
            ("NumPy / Numba", f"{numpy.__version__} / {numba.__version__}"),
            ("threads per rank", threads.setting().describe() if threads.setting() else "not set"),
            ("CuPy", "yes, GPU present" if gpu_available() else
                     ("installed, no GPU" if cupy_available() else "not installed")),
            ("Python", f"{platform.python_version()} on {platform.machine()}"),
            ("allreduce auto", _auto_line(select, comm)),
        ]
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
        sys.stdout.flush()
    comm.free()
    return 0


def _auto_line(select, comm) -> str:
    """Where "auto" takes its choices from on this layout: a table, or the built-in rule."""
    try:
        return select.describe(comm)
    except ValueError as exc:
        return f"{exc}"


def _bench_names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(mpidist.bench.__path__)
                  if not m.name.startswith("_"))


def bench(argv: list[str]) -> int:
    """`mpidist bench NAME [options]`: run mpidist.bench.NAME.main; returns the exit code."""
    names = _bench_names()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mpidist bench NAME [options]\nbenchmarks: " + (", ".join(names) or "none"))
        return 0 if argv else 2
    name = argv[0]
    if name not in names:
        print(f"mpidist bench: unknown benchmark {name!r}; available: {', '.join(names)}",
              file=sys.stderr)
        return 2
    return int(importlib.import_module(f"mpidist.bench.{name}").main(argv[1:]) or 0)


def main(argv: list[str] | None = None) -> int:
    """The `mpidist` command: dispatch to a subcommand; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"info": "MPI, topology, h5py/Numba/CuPy support of this job",
                "bench": "benchmarks: mpidist bench NAME (allreduce, optim, ...)",
                "run": "start a command on N local ranks: mpidist run -n 4 -- CMD",
                **{k: v for k, (_, v) in _DISPATCH.items()}}
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mpidist COMMAND [options]\n\ncommands:")
        for k, v in commands.items():
            print(f"  {k:<8} {v}")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "run":
        return launch(rest)
    if cmd not in ("info", "bench", *_DISPATCH):
        print(f"mpidist: unknown command {cmd!r}; commands: {', '.join(commands)}",
              file=sys.stderr)
        return 2
    problem = unwired_launch()          # before MPI_Init, which would fail or run alone
    if problem is not None:
        if cmd == "doctor":
            print(f"mpidist doctor: task {os.environ.get('SLURM_PROCID')} of an srun step\n"
                  f"[FAIL] job  {problem}", flush=True)
        else:
            print(f"mpidist {cmd}: {problem}", file=sys.stderr, flush=True)
        return 1
    try:
        if cmd == "info":
            return info(rest)
        if cmd == "bench":
            return bench(rest)
        return int(importlib.import_module(_DISPATCH[cmd][0]).main(rest) or 0)
    except Exception:
        _abort_job(cmd)
        raise


def _abort_job(cmd: str) -> None:
    """After an unexpected exception on this rank of a multi-rank job: print it and end the
    whole job with MPI_Abort, since the other ranks may wait for this one in a collective
    forever (not every MPI's launcher ends a job when one rank exits with an error)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() \
            or mpi.COMM_WORLD.Get_size() == 1:
        return
    print(f"mpidist {cmd}: unexpected error on rank {mpi.COMM_WORLD.Get_rank()}, aborting the "
          f"job\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    abort_job(mpi.COMM_WORLD, 1)
