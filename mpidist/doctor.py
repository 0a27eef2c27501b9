"""`mpidist doctor`: is this launch what the user thinks it is?

Run it as the job would run: `mpiexec -n N mpidist doctor`, `srun ... mpidist doctor`, or
alone. Every rank gathers a few facts about itself (how the launcher started it, the MPI
library it loaded, cores, GPUs); rank 0 prints one line per check with a verdict, and a fix
under each one that is not ok. The checks are data (CHECKS): each is a function from the
gathered facts to (verdict, what was found, what to do). The exit code is 1 on every rank
when any check fails, so a batch script can stop before the real job:

    srun mpidist doctor && srun mpidist train job.toml

See docs/ARCHITECTURE.md (benchmarks and CLI).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from dataclasses import dataclass

import h5py
import numpy as np
from mpi4py import MPI

from mpidist import mpilib, threads
from mpidist.comm import Communicator, cuda_aware_mpi, mpi_library
from mpidist.errors import format_ranks
from mpidist.h5 import parallel_hdf5
from mpidist.kernels.backend import gpu_available
from mpidist.launcher import cma_permitted, mpi_vendor

__all__ = ["CHECKS", "Verdict", "facts", "diagnose", "main"]

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"
# the launcher's word on the job's size, by launcher
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS",
              "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")


@dataclass(frozen=True)
class Verdict:
    """One line of the report: status (ok, warn, fail), what was found, and the fix."""
    status: str
    found: str
    fix: str = ""


def facts(comm: Communicator) -> dict:
    """This rank's facts (collective only in the live one-sided test, run by the caller)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        import numba                    # slow to import: only the doctor's facts need it
        numba_threads = int(numba.get_num_threads())      # mpidist.threads' setting
        numba_layer = str(numba.config.THREADING_LAYER)
    except Exception:
        numba_threads, numba_layer = 0, "unavailable"
    gpus = 0
    if gpu_available():
        import cupy                     # optional: a GPU is present
        gpus = cupy.cuda.runtime.getDeviceCount()
    return {
        "rank": comm.rank, "size": comm.size, "host": MPI.Get_processor_name(),
        "node": comm.node, "local_size": comm.local_size, "cores": cores,
        "launcher": {v: os.environ[v] for v in _SIZE_VARS if os.environ.get(v)},
        "library": mpi_library(), "libmpi": mpilib.path(), "abi": mpilib.abi(),
        "family": mpilib.family(),
        "thread_level": MPI.Query_thread(), "gpus": gpus,
        "numba_threads": numba_threads, "numba_layer": numba_layer,
        "threads": threads.setting().describe() if threads.setting() else "not set",
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("OMPI_MCA_", "MPIR_CVAR_", "MPIDIST_", "MPI4PY_"))},
    }


def _rma_works(comm: Communicator) -> str:
    """Collective: the parameter server's one-sided operations, once, between all ranks:
    Fetch_and_op and Accumulate on int64 words of every rank's window. '' or the error."""
    error = ""
    win = MPI.Win.Allocate(8 * (1 + comm.size), 8, comm=comm.comm)
    try:
        win.Lock(comm.rank, MPI.LOCK_EXCLUSIVE)        # Allocate's memory is uninitialised
        np.frombuffer(win.tomemory(), np.int64)[:] = 0
        win.Unlock(comm.rank)
        comm.comm.Barrier()
        win.Lock_all(MPI.MODE_NOCHECK)
        one, res = np.ones(1, np.int64), np.zeros(1, np.int64)
        for r in range(comm.size):
            win.Fetch_and_op(one, res, r, 0, MPI.SUM)
            win.Accumulate([one, MPI.INT64_T], r, (1 + comm.rank, 1, MPI.INT64_T), MPI.REPLACE)
        win.Flush_all()
        win.Unlock_all()
        comm.comm.Barrier()
        win.Lock(comm.rank, MPI.LOCK_SHARED)
        mine = np.frombuffer(win.tomemory(), np.int64).copy()
        win.Unlock(comm.rank)
        if mine[0] != comm.size or (mine[1:] != 1).any():
            error = f"rank {comm.rank}'s window reads {mine.tolist()} after {comm.size} atomic " \
                    f"adds and one store from each rank"
    except MPI.Exception as exc:
        error = str(exc)
    finally:
        win.Free()
    return error


# -- the checks: facts of every rank -> Verdict -------------------------------------------

def check_job(all_facts: list[dict], expect: int | None) -> Verdict:
    """One job of the expected size, not N singletons."""
    size = all_facts[0]["size"]
    told = {v: int(n) for v, n in all_facts[0]["launcher"].items() if n.isdigit()}
    wanted = expect or max(told.values(), default=None)
    hosts = sorted({f["host"] for f in all_facts})
    where = f"{size} rank{'s' if size > 1 else ''} in one MPI job on {len(hosts)} host(s)"
    if wanted is not None and wanted != size:
        source = f"--expect {expect}" if expect else ", ".join(f"{v}={n}" for v, n in told.items())
        if size == 1:
            return Verdict(FAIL, f"this rank is alone (an MPI world of 1) but {source}: the launcher "
                                 f"started {wanted} separate one-rank jobs, each of which would train alone",
                           "MPI is not wired to the launcher's process manager: under SLURM use "
                           "`srun --mpi=pmix` (or pmi2; `srun --mpi=list` shows them), or `mpirun` inside "
                           "the allocation; make sure mpi4py uses the MPI that srun/mpiexec belongs to")
        return Verdict(FAIL, f"{where}, but {source}",
                       "start the job with the size you expect, or pass --expect N")
    if not told and size == 1:
        return Verdict(OK, "1 rank, started without a launcher (a singleton)",
                       "")
    return Verdict(OK, where + (f" ({', '.join(f'{v}={n}' for v, n in told.items())})" if told else ""))


def check_library(all_facts: list[dict], launcher_vendor: str) -> Verdict:
    """mpi4py's MPI library against the launcher's, the same on every rank."""
    libs = Counter(f["library"] for f in all_facts)
    mine = all_facts[0]
    found = f"{mine['library']} (ABI {mine.get('abi', '?')}); mpi4py {__import__('mpi4py').__version__}" + \
        (f"; libmpi {mine['libmpi']}" if mine["libmpi"] else "")
    if len(libs) > 1:
        return Verdict(FAIL, "ranks loaded different MPI libraries: " +
                       "; ".join(f"{n} x {lib}" for lib, n in libs.items()),
                       "make every node load the same MPI module and mpi4py build")
    lib = mine["library"].lower()
    loaded = "openmpi" if "open mpi" in lib else "mpich" if ("mpich" in lib or "hydra" in lib) else "other"
    if launcher_vendor != "other" and loaded != "other" and loaded != launcher_vendor:
        return Verdict(FAIL, f"{found}, but the mpiexec on PATH is {launcher_vendor}'s",
                       "mpi4py and mpiexec come from different MPI libraries (a pip wheel's MPI beside "
                       "the site's?): rebuild mpi4py against the site's MPI (`pip install --no-binary "
                       "mpi4py mpi4py` with the site's mpicc), or use the mpiexec of mpi4py's MPI")
    if "site-packages" in mine["libmpi"] or "dist-packages" in mine["libmpi"]:
        return Verdict(WARN, found + " (an MPI from a Python wheel)",
                       "on a cluster, mpi4py should use the site's MPI, built for its network: "
                       "`pip install --no-binary mpi4py mpi4py` after loading the MPI module")
    return Verdict(OK, found)


def check_threads(all_facts: list[dict]) -> Verdict:
    """The MPI thread level (the parameter server and helper threads need multiple)."""
    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    level = min(f["thread_level"] for f in all_facts)
    if level == MPI.THREAD_MULTIPLE:
        return Verdict(OK, "MPI_THREAD_MULTIPLE: asynchronous allreduce overlaps with backward")
    return Verdict(WARN, f"MPI_THREAD_{names.get(level, level).upper()}: allreduce_async runs "
                         "inside the call, without overlap",
                   "unset MPI4PY_RC_THREAD_LEVEL (mpi4py asks for multiple), or use an MPI "
                   "library built with thread support")


def check_placement(all_facts: list[dict]) -> Verdict:
    """Ranks per node against the cores they may run on."""
    per_node = Counter(f["node"] for f in all_facts)
    cores = all_facts[0]["cores"]              # the cores rank 0 may run on
    found = f"{len(per_node)} node(s), ranks per node: " \
            f"{', '.join(str(c) for _, c in sorted(per_node.items()))}; {cores} core(s) per rank"
    if max(per_node.values()) <= cores:
        return Verdict(OK, found)
    if all_facts[0]["env"].get("OMPI_MCA_mpi_yield_when_idle") == "1":
        return Verdict(WARN, found + "; oversubscribed, idle ranks yield their core",
                       "fine for tests; for speed run at most one rank per core")
    return Verdict(WARN, found + "; oversubscribed, and waiting ranks busy-poll",
                   "run at most one rank per core, or (Open MPI) set OMPI_MCA_mpi_yield_when_idle=1 "
                   "(mpidist.launcher does)")


def check_shared_memory(all_facts: list[dict], cma: bool, rma_error: str) -> Verdict:
    """One-sided atomics (tried live) and the single-copy transport."""
    env = all_facts[0]["env"]
    single_copy = env.get("OMPI_MCA_btl_vader_single_copy_mechanism", "default")
    if rma_error:
        return Verdict(FAIL, f"one-sided operations failed: {rma_error}",
                       "the parameter server and the shm allreduce need MPI one-sided RMA; "
                       "check the MPI library's osc components (ompi_info | grep osc)")
    if all_facts[0].get("family") != "openmpi":
        return Verdict(OK, "one-sided atomics work between all ranks")
    if not cma and single_copy not in ("none",):
        return Verdict(WARN, "this machine forbids cross-memory attach (ptrace), which Open MPI's "
                             "single-copy transport uses; one-sided atomics work",
                       "set OMPI_MCA_btl_vader_single_copy_mechanism=none (mpidist.launcher does)")
    return Verdict(OK, f"single copy {'permitted' if cma else 'off'} "
                       f"(btl_vader_single_copy_mechanism={single_copy}); one-sided atomics work")


def check_gpu(all_facts: list[dict], cuda_aware: bool) -> Verdict:
    """GPUs per node against ranks per node, and CUDA-awareness."""
    gpus = Counter()
    for f in all_facts:
        gpus[f["node"]] = f["gpus"]
    if not any(gpus.values()):
        return Verdict(INFO, "no CUDA GPU (or no CuPy): CPU training")
    per_node = Counter(f["node"] for f in all_facts)
    found = ", ".join(f"node {n}: {gpus[n]} GPU(s) for {per_node[n]} rank(s)" for n in sorted(gpus))
    found += "; MPI " + ("is CUDA-aware" if cuda_aware else "is not CUDA-aware: device buffers "
                         "are staged through pinned host memory")
    if any(per_node[n] > gpus[n] for n in gpus):
        return Verdict(WARN, found, "more ranks than GPUs on a node: ranks share GPUs")
    return Verdict(OK, found)


def check_hdf5(all_facts: list[dict], mpio: bool) -> Verdict:
    """Whether h5py has MPI-IO (parallel checkpoints) or writes in turns."""
    if mpio:
        return Verdict(OK, f"h5py {h5py.__version__} with MPI-IO: checkpoints written in parallel")
    return Verdict(WARN, f"h5py {h5py.__version__} without MPI-IO (or MPIDIST_HDF5_MPIO=0): "
                         "checkpoints are written by the ranks in turns",
                   "build h5py against parallel HDF5: CC=mpicc HDF5_MPI=ON pip install --no-binary=h5py h5py")


def check_numba(all_facts: list[dict]) -> Verdict:
    """Numba's threading layer and threads per rank against the cores."""
    f = all_facts[0]
    ranks = max(Counter(x["node"] for x in all_facts).values())
    found = (f"threading layer {f['numba_layer']}, threads per rank: "
             f"{f.get('threads', f['numba_threads'])}")
    if f["numba_threads"] > 1 and f["numba_threads"] * ranks > f["cores"]:
        return Verdict(WARN, f"{found} x {ranks} rank(s) per node on {f['cores']} core(s)",
                       "unset NUMBA_NUM_THREADS (mpidist then shares the cores among the "
                       "node's ranks) or set it to cores / ranks per node")
    return Verdict(OK, found)


def check_ulfm(all_facts: list[dict]) -> Verdict:
    """Whether the MPI library offers ULFM (fault_tolerance = "shrink")."""
    lib = all_facts[0]["library"]
    env = all_facts[0]["env"]
    has_api = hasattr(MPI.Comm, "Shrink") and hasattr(MPI.Comm, "Revoke")
    active = mpilib.ulfm_switched_on(env)
    if not has_api:
        return Verdict(INFO, "mpi4py has no ULFM API (Comm.Shrink/Revoke): fault_tolerance unavailable")
    if active:
        return Verdict(OK, "ULFM active (mpiexec --with-ft ulfm): fault_tolerance = 'shrink' can recover")
    if "Open MPI v5" in lib or "Open MPI v6" in lib:
        return Verdict(INFO, "ULFM off: start with `mpiexec --with-ft ulfm` (mpidist.launcher --ft) "
                             "to survive a lost rank")
    if all_facts[0].get("family") == "mpich":
        return Verdict(INFO, "ULFM off: MPICH turns it on with MPIR_CVAR_ENABLE_FT=1 in every rank's "
                             "environment")
    return Verdict(INFO, "no ULFM in this MPI library: a lost rank ends the job (Open MPI 5 has it: "
                         "MPIDIST_MPI=ompi5-ft bash scripts/setup_env.sh)")


CHECKS = ("job", "MPI library", "thread level", "placement", "shared memory", "GPU",
          "parallel HDF5", "Numba", "ULFM")


def diagnose(all_facts: list[dict], *, expect=None, launcher_vendor="other", cma=True,
             rma_error="", cuda_aware=False, mpio=True) -> list[tuple[str, Verdict]]:
    """Every check's verdict, in CHECKS order, from every rank's facts (pure)."""
    verdicts = [
        check_job(all_facts, expect), check_library(all_facts, launcher_vendor),
        check_threads(all_facts), check_placement(all_facts),
        check_shared_memory(all_facts, cma, rma_error), check_gpu(all_facts, cuda_aware),
        check_hdf5(all_facts, mpio), check_numba(all_facts), check_ulfm(all_facts)]
    return list(zip(CHECKS, verdicts))


def main(argv: list[str] | None = None) -> int:
    """`mpidist doctor`: every check, one verdict per line; exit 1 on a failure."""
    parser = argparse.ArgumentParser(prog="mpidist doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--expect", type=int, default=None,
                        help="the number of ranks the job should have (default: the launcher's)")
    args = parser.parse_args(argv)
    comm = Communicator()
    mine = facts(comm)
    rma_error = _rma_works(comm)
    all_facts = comm.comm.gather(mine, root=0)
    errors = comm.comm.gather(rma_error, root=0)
    failed = False
    if comm.rank == 0:
        bad = [(r, e) for r, e in enumerate(errors) if e]
        verdicts = diagnose(all_facts, expect=args.expect, launcher_vendor=mpi_vendor(),
                            cma=cma_permitted(), cuda_aware=cuda_aware_mpi(), mpio=parallel_hdf5(),
                            rma_error="; ".join(f"rank {r}: {e}" for r, e in bad))
        print(f"mpidist doctor: rank 0 of {comm.size} on {mine['host']}"
              + (f" (ranks {format_ranks(range(comm.size))})" if comm.size > 1 else ""))
        width = max(len(name) for name in CHECKS)
        for name, v in verdicts:
            print(f"[{v.status:^4}] {name:<{width}}  {v.found}")
            if v.fix and v.status in (WARN, FAIL):
                print(f"{'':6} {'':<{width}}  fix: {v.fix}")
        failed = any(v.status == FAIL for _, v in verdicts)
        sys.stdout.flush()
    failed = comm.comm.bcast(failed, root=0)
    comm.free()
    return 1 if failed else 0
