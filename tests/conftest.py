"""The MPI test harness.

The suite runs with plain `pytest` (one rank) and under `mpiexec -n N python -m pytest`.
- Every test's outcome is agreed across ranks before it is reported: a failure (or error)
  on any rank fails the test on every rank, naming the ranks, so no rank reports a pass
  that another contradicts, and no rank runs ahead into the next test's collectives.
- Per-test timeouts (pytest-timeout, thread method) kill a deadlocked rank, which makes
  mpiexec abort the whole job: a deadlock fails instead of hanging CI.
- Markers: `mpi(min_size=k)` skips below k ranks; `gpu` skips without a CUDA GPU;
  `launcher` tests start their own processes and run only in the single-rank session.
- Ranks other than 0 write their pytest output to a log file (MPIDIST_TEST_LOGDIR), so the
  terminal shows one report.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest
from mpi4py import MPI

_WORLD = MPI.COMM_WORLD
_HARNESS = _WORLD.Dup()          # the harness's own channel: never mixed with test traffic
RANK, SIZE = _HARNESS.Get_rank(), _HARNESS.Get_size()
_RANK_LOG = None                 # ranks > 0: the file their report goes to


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # a rank blocked inside MPI never sees a signal: only the thread method can stop it
    if getattr(config.option, "timeout_method", None) in (None, "signal"):
        config.option.timeout_method = "thread"
    config.addinivalue_line("markers", "mpi(min_size=1): needs at least min_size MPI ranks")
    config.addinivalue_line("markers", "gpu: needs CuPy and a CUDA GPU")
    config.addinivalue_line("markers", "launcher: starts its own mpiexec/processes; runs only "
                                       "in the single-rank session")
    if RANK != 0:
        config.option.xmlpath = None          # one JUnit report per run, from rank 0
        logdir = os.environ.get("MPIDIST_TEST_LOGDIR")
        if logdir:
            os.makedirs(logdir, exist_ok=True)
        path = os.path.join(logdir, f"rank{RANK}.log") if logdir else os.devnull
        global _RANK_LOG
        _RANK_LOG = open(path, "w", buffering=1)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(_RANK_LOG.fileno(), 1)        # what this rank prints outside pytest's capture
        os.dup2(_RANK_LOG.fileno(), 2)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Ranks other than 0 write their pytest report to their log, not the terminal."""
    if _RANK_LOG is not None:
        from _pytest.config import create_terminal_writer
        reporter = session.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            reporter._tw = create_terminal_writer(session.config, _RANK_LOG)


def pytest_report_header(config):
    from mpidist.comm import mpi_library
    return [f"mpi: {mpi_library()}", f"mpi ranks: {SIZE} (this is rank {RANK})",
            f"mpi4py: {__import__('mpi4py').__version__}"]


def pytest_collection_modifyitems(config, items):
    """Launcher tests run once, in the single-rank session; under mpiexec they are deselected."""
    if SIZE > 1:
        keep = [it for it in items if it.get_closest_marker("launcher") is None]
        dropped = [it for it in items if it.get_closest_marker("launcher") is not None]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
    # every rank must run the same tests in the same order
    names = _HARNESS.allgather([it.nodeid for it in items])
    if any(n != names[0] for n in names):
        raise pytest.UsageError("ranks collected different tests; run the same pytest "
                                "command line on every rank")


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("mpi")
    if marker is not None:
        need = marker.kwargs.get("min_size", marker.args[0] if marker.args else 1)
        if SIZE < need:
            pytest.skip(f"needs at least {need} MPI ranks (running on {SIZE})")
    if item.get_closest_marker("gpu") is not None:
        from mpidist.kernels.backend import gpu_available
        if not gpu_available():
            pytest.skip("needs CuPy and a CUDA GPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Agree each phase's outcome across ranks; a failure anywhere fails it everywhere."""
    outcome = yield
    report = outcome.get_result()
    if SIZE == 1:
        return
    status = "failed" if report.failed else ("skipped" if report.skipped else "passed")
    statuses = _HARNESS.allgather(status)
    failed = [r for r, s in enumerate(statuses) if s == "failed"]
    if failed and not report.failed:
        report.outcome = "failed"
        report.longrepr = (f"{call.when} failed on rank(s) {failed} of {SIZE}; "
                           f"see their log (MPIDIST_TEST_LOGDIR)")
    elif not failed and report.passed and "skipped" in statuses and call.when == "setup":
        # a rank-dependent skip would desynchronise the ranks: skip everywhere
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1], "skipped on another rank")
    elif failed and report.failed and len(failed) < SIZE and hasattr(report, "sections"):
        report.sections.append(("mpi", f"failed on rank(s) {failed} of {SIZE}"))


@pytest.fixture
def comm():
    """A fresh mpidist Communicator (private Dup of COMM_WORLD), freed after the test."""
    from mpidist.comm import Communicator
    c = Communicator()
    yield c
    c.free()


@pytest.fixture
def shared_dir(comm):
    """One temporary directory, the same path on every rank, removed afterwards."""
    path = comm.comm.bcast(tempfile.mkdtemp(prefix="mpidist-test-") if comm.rank == 0 else None,
                           root=0)
    yield path
    comm.comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def rank():
    return RANK


@pytest.fixture
def size():
    return SIZE
