"""`mpidist bench checkpoint`: parallel-HDF5 checkpoint write and read bandwidth, against a
plain sequential write of the same bytes (numpy.tofile) to the same filesystem, same run.

    python -m mpidist.launcher -n 4 -- mpidist bench checkpoint                  # 1 GiB of state
    python -m mpidist.launcher -n 4 -- mpidist bench checkpoint --size-mb 256 --repeat 3

What it measures, and how: main()'s docstring. See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import numpy as np

from mpidist.bench.rows import write_rows
from mpidist.checkpoint import CheckpointManager, open_checkpoint
from mpidist.checkpoint.writer import collective_io, fsync_path
from mpidist.comm import default_communicator
from mpidist.h5 import parallel_hdf5
from mpidist.partition import chunk

__all__ = ["main", "bench_state"]


class _Piece:
    def __init__(self, shape, offset, data):
        self.shape, self.offset, self.data = shape, offset, data


def bench_state(size_bytes: int, tensors: int, rank: int, size: int) -> dict:
    """This rank's chunk() of `tensors` float32 tensors of size_bytes in all."""
    layers = max(1, tensors // 3)
    per = max(1, size_bytes // 4 // (3 * layers))
    rng = np.random.default_rng(rank)
    state = {}
    for i in range(layers):
        for kind in ("params", "optim/exp_avg", "optim/exp_avg_sq"):
            o, c = chunk(per, rank, size)
            state[f"{kind}/layer{i}.weight"] = _Piece((per,), o, rng.random(c, dtype=np.float32))
    return state


def _io_mode(collective: bool, io: str) -> str:
    """How the checkpoint writes: the MPI-IO mode, or in turns without MPI-IO."""
    if not parallel_hdf5():
        return "ranks in turns (no MPI-IO)"
    return f"{'collective' if collective else 'independent'} MPI-IO ({io})"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code.

    The state is ZeRO-like: --tensors float32 tensors (params, exp_avg, exp_avg_sq of a stack
    of layers) of --size-mb MiB in all, each rank holding its chunk() of every tensor.
    Phases, each repeated --repeat times (best and median reported):
      1. plain: rank 0 writes all the bytes with numpy.tofile into one file, then fsync
         (the other ranks wait in a barrier)
      2. write: CheckpointManager.save on every rank: MPI-IO as --io says (default auto:
         collective across nodes, independent within one; the ranks in turns where h5py has
         no MPI or MPIDIST_HDF5_MPIO=0), CRC-32 of every slice, fsync, atomic rename
      3. read: open_checkpoint (verifies every tensor's CRC, each rank reading its chunk), then
         every rank reads its chunk() of every tensor, as a resuming ZeRO job does
    ratio = plain seconds / checkpoint write seconds (the target is >= 0.7).
    Writes checkpoint.csv and checkpoint.json under --out (rank 0).
    """
    p = argparse.ArgumentParser(prog="mpidist bench checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=float, default=1024.0, help="MiB of state in all (default 1024)")
    p.add_argument("--tensors", type=int, default=24, help="number of tensors (default 24)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions of each phase (default 3)")
    p.add_argument("--io", choices=("auto", "collective", "independent"), default="auto",
                   help="MPI-IO writes (default auto: collective across nodes, independent "
                        "within one)")
    p.add_argument("--no-fsync", action="store_true",
                   help="neither write is fsync'ed (compares page-cache writes, less noisy on a "
                        "shared disk; default: both are made durable)")
    p.add_argument("--dir", default=None, help="scratch directory on the filesystem to measure "
                                               "(default: <out>/scratch, removed afterwards)")
    p.add_argument("--out", default=os.path.join("results", "bench", "checkpoint"))
    a = p.parse_args(argv)
    if a.size_mb <= 0 or a.repeat < 1 or a.tensors < 1:
        p.error("--size-mb, --repeat and --tensors must be positive")


    comm = default_communicator()
    c = comm.comm
    scratch = a.dir or os.path.join(a.out, "scratch")
    if comm.rank == 0:
        os.makedirs(scratch, exist_ok=True)
        os.makedirs(a.out, exist_ok=True)
    c.Barrier()
    state = bench_state(int(a.size_mb * 2**20), a.tensors, comm.rank, comm.size)
    nbytes = c.allreduce(sum(t.data.nbytes for t in state.values()))
    collective = collective_io(comm) if a.io == "auto" else a.io == "collective"
    mgr = CheckpointManager(scratch, keep=1, comm=comm, collective=collective,
                            fsync=not a.no_fsync)
    plain_buf = np.random.default_rng(99).random(nbytes // 4, dtype=np.float32) if comm.rank == 0 else None
    times: dict = {"plain": [], "write": [], "read": []}
    for rep in range(a.repeat):
        # 1. plain sequential write of the same bytes by one process
        c.Barrier()
        if comm.rank == 0:
            path = os.path.join(scratch, "plain.bin")
            t0 = time.perf_counter()
            plain_buf.tofile(path)
            if not a.no_fsync:
                fsync_path(path)
            times["plain"].append(time.perf_counter() - t0)
            os.remove(path)
        c.Barrier()
        # 2. the checkpoint write (collective, CRCs, fsync, rename)
        t0 = time.perf_counter()
        path = mgr.save(rep + 1, state)
        c.Barrier()
        times["write"].append(time.perf_counter() - t0)
        # 3. open + verify + every rank reads its chunk of every tensor
        t0 = time.perf_counter()
        with open_checkpoint(path, comm=comm) as src:
            for key in src.keys():
                o, n = chunk(int(np.prod(src.shape(key))), comm.rank, comm.size)
                src.read(key, o, n)
        c.Barrier()
        times["read"].append(time.perf_counter() - t0)
    if comm.rank == 0:
        if a.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            os.remove(mgr.path(a.repeat))
    if comm.rank != 0:
        return 0
    gib = nbytes / 2**30
    best = {k: min(v) for k, v in times.items() if v}
    med = {k: statistics.median(v) for k, v in times.items() if v}
    rows = [{"phase": k, "best_s": best[k], "median_s": med[k], "GiB_per_s_best": gib / best[k],
             "GiB_per_s_median": gib / med[k]} for k in ("plain", "write", "read")]
    ratio_best = best["plain"] / best["write"]
    ratio_med = med["plain"] / med["write"]
    # each repeat writes plain then checkpoint back to back: their ratio sees the same disk load
    ratio_pairs = statistics.median(p / w for p, w in zip(times["plain"], times["write"]))
    print(f"mpidist bench checkpoint: {comm.size} ranks, {gib:.3f} GiB in {len(state)} tensors, "
          f"{_io_mode(collective, a.io)}, "
          f"{'no fsync' if a.no_fsync else 'fsync'}, {a.repeat} repeats, "
          f"scratch {os.path.abspath(scratch)}")
    print(f"{'phase':<8} {'best s':>8} {'median s':>9} {'GiB/s best':>11} {'GiB/s median':>13}")
    for r in rows:
        print(f"{r['phase']:<8} {r['best_s']:>8.3f} {r['median_s']:>9.3f} {r['GiB_per_s_best']:>11.3f} "
              f"{r['GiB_per_s_median']:>13.3f}")
    print(f"write bandwidth / plain numpy.tofile bandwidth: {ratio_best:.2f} (best), "
          f"{ratio_med:.2f} (median), {ratio_pairs:.2f} (median of back-to-back pairs); "
          f"target >= 0.7")
    write_rows(a.out, "checkpoint", rows, {
        "ranks": comm.size, "bytes": nbytes, "tensors": len(state), "collective": collective,
        "repeat": a.repeat, "times": times, "fsync": not a.no_fsync, "ratio_best": ratio_best,
        "ratio_median": ratio_med, "ratio_pairs_median": ratio_pairs})
    return 0
