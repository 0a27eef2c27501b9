"""The MPI test harness.

The suite runs with plain `pytest` (one rank) and under `mpiexec -n N python -m pytest`.
- Every test's outcome is agreed across ranks before it is reported: a failure (or error)
  on any rank fails the test on every rank, naming the ranks, so no rank reports a pass
  that another contradicts, and no rank runs ahead into the next test's collectives.
- Per-test timeouts (pytest-timeout, thread method) kill a deadlocked rank, which makes
  mpiexec abort the whole job: a deadlock fails instead of hanging CI. Shortly before,
  every rank writes where its threads wait to stacks-rank<R>.txt in MPIDIST_TEST_LOGDIR,
  since the first rank to time out ends the job and only its stack would be seen.
- The `comm` fixture is a fresh mpidist Communicator. In the files the `every_comm` ini
  option names (setup.cfg), a test that takes it runs three times, on the communicators a
  host code with its own communicator would pass: the world's duplicate (`[world]`),
  `COMM_SELF` (`[self]`) and a sub-communicator of the first p-1 ranks, made once (`[sub]`;
  at one rank, a split of one). Ranks outside the sub-communicator skip its cases before
  any fixture runs; its members agree on the outcome among themselves, every rank on the
  setup and teardown, so all ranks go through the same tests. A test marked
  `world("why")` runs on the world's duplicate only.
- Markers: `mpi(min_size=k)` skips where the test's communicator (the world without
  `comm`) has fewer than k ranks; `gpu` skips without a CUDA GPU; `launcher` tests start
  their own processes and run only in the single-rank session.
- Ranks other than 0 write their pytest output to a log file (MPIDIST_TEST_LOGDIR), so the
  terminal shows one report.
"""
from __future__ import annotations

import faulthandler
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from mpi4py import MPI

_WORLD = MPI.COMM_WORLD
_HARNESS = _WORLD.Dup()          # the harness's own channel: never mixed with test traffic
RANK, SIZE = _HARNESS.Get_rank(), _HARNESS.Get_size()
_RANK_LOG = None                 # ranks > 0: the file their report goes to
_STACKS = None                   # where this rank's stacks go if a test nears its timeout
_NATIVE = None                   # the process that then adds the native ones (gdb)
_KEPT = 0                        # stacks files kept from earlier armings
STACK_LEAD = 20                  # seconds before the timeout that the stacks are written
                                 # (a quarter of it for timeouts under 80 s)

# the host code's sub-communicator (first max(p-1, 1) ranks), made once, and the harness's
# channel among its members
_IN_SUB = RANK < max(SIZE - 1, 1)
_SUB = _WORLD.Split(0 if _IN_SUB else MPI.UNDEFINED, RANK)
_SUB_HARNESS = _SUB.Dup() if _IN_SUB else None
COMM_SIZES = {"world": SIZE, "self": 1, "sub": max(SIZE - 1, 1)}


def _comm_kind(item) -> str | None:
    """Which communicator the item's `comm` is ("world", "self", "sub"); None without one."""
    if "comm" not in getattr(item, "fixturenames", ()):
        return None
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("comm", "world") if callspec else "world"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # a rank blocked inside MPI never sees a signal: only the thread method can stop it
    if getattr(config.option, "timeout_method", None) in (None, "signal"):
        config.option.timeout_method = "thread"
    config.addinivalue_line("markers", "mpi(min_size=1): needs at least min_size MPI ranks")
    config.addinivalue_line("markers", "gpu: needs CuPy and a CUDA GPU")
    config.addinivalue_line("markers", "launcher: starts its own mpiexec/processes; runs only "
                                       "in the single-rank session")
    config.addinivalue_line("markers", "world(reason): `comm` is the world's duplicate only, "
                                       "in a file where it would also be COMM_SELF and a "
                                       "sub-communicator")
    logdir = os.environ.get("MPIDIST_TEST_LOGDIR")
    if logdir:
        os.makedirs(logdir, exist_ok=True)
        if SIZE > 1:
            global _STACKS, _NATIVE
            path = os.path.join(logdir, f"stacks-rank{RANK}.txt")
            _STACKS = open(path, "w+")
            if shutil.which("gdb"):           # the native stacks too, once Python's are written
                _NATIVE = subprocess.Popen(
                    [sys.executable, os.path.join(os.path.dirname(__file__), "native_stacks.py"),
                     str(os.getpid()), path, os.path.join(logdir, f"native-rank{RANK}.txt")],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    if RANK != 0:
        config.option.xmlpath = None          # one JUnit report per run, from rank 0
        path = os.path.join(logdir, f"rank{RANK}.log") if logdir else os.devnull
        global _RANK_LOG
        _RANK_LOG = open(path, "w", buffering=1)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(_RANK_LOG.fileno(), 1)        # what this rank prints outside pytest's capture
        os.dup2(_RANK_LOG.fileno(), 2)


def pytest_unconfigure(config):
    if _NATIVE is not None:
        _NATIVE.terminate()
        _NATIVE.wait(timeout=10)
    if _STACKS is not None:
        faulthandler.cancel_dump_traceback_later()
        _STACKS.seek(0)
        _STACKS.truncate()                  # the session ended: nothing held it up
        _STACKS.close()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Ranks other than 0 write their pytest report to their log, not the terminal."""
    if _RANK_LOG is not None:
        from _pytest.config import create_terminal_writer
        reporter = session.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            reporter._tw = create_terminal_writer(session.config, _RANK_LOG)


def _timeout_of(item) -> float:
    """pytest-timeout's limit for the item: its `timeout` marker, else --timeout, else the ini."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        return float(marker.kwargs.get("timeout", marker.args[0] if marker.args else 0) or 0)
    return float(item.config.getoption("timeout", None) or item.config.getini("timeout") or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Arm faulthandler to write every thread's stack, under a line naming the rank and the
    test, STACK_LEAD seconds before the timeout; a test that ends in time leaves nothing.
    Between one test and the next the same timer stays armed, under a line saying so: a
    rank held up there (where no test's timeout runs) shows where too."""
    limit = _timeout_of(item)
    armed = _STACKS is not None and limit > 0
    after = limit - min(STACK_LEAD, limit / 4)
    if armed:
        _arm_stacks(after, f"{item.nodeid} still runs after {after:g} s (timeout {limit:g} s)")
    try:
        yield
    finally:
        if armed:
            _arm_stacks(after, f"{after:g} s after {item.nodeid} ended, the next test has not "
                               f"started")


def _arm_stacks(after: float, what: str) -> None:
    """This rank's stacks file: emptied, headed by `what`, its threads' stacks written
    into it `after` seconds from now unless re-armed first. Stacks the timer wrote since
    the last arming are kept first, in stacks-rankN.K.txt (a rank that was held up and
    then went on leaves where it was held)."""
    _STACKS.seek(0)
    written = _STACKS.read()
    if "most recent call first" in written:
        global _KEPT
        _KEPT += 1
        with open(_STACKS.name[:-len(".txt")] + f".{_KEPT}.txt", "w") as kept:
            kept.write(written)
    _STACKS.seek(0)
    _STACKS.truncate()
    _STACKS.write(f"rank {RANK} of {SIZE}: {what}; its threads:\n")
    _STACKS.flush()
    faulthandler.dump_traceback_later(after, file=_STACKS)


def pytest_addoption(parser):
    parser.addini("every_comm", "files and folders (from the rootdir) whose `comm` tests run "
                  "on the world's duplicate, COMM_SELF and a sub-communicator",
                  type="linelist", default=[])


def pytest_generate_tests(metafunc):
    """`comm` on all three communicators where every_comm names the file and the test is
    not marked `world`."""
    if "comm" not in metafunc.fixturenames or metafunc.definition.get_closest_marker("world"):
        return
    root, path = metafunc.config.rootpath, metafunc.definition.path
    if any(path == root / p or path.is_relative_to(root / p)
           for p in metafunc.config.getini("every_comm")):
        # a test that needs several ranks never runs on COMM_SELF, at any world size: no
        # such item is made (it would only ever skip)
        marker = metafunc.definition.get_closest_marker("mpi")
        need = 1 if marker is None else marker.kwargs.get("min_size",
                                                           marker.args[0] if marker.args else 1)
        kinds = [k for k in COMM_SIZES if k != "self" or need <= 1]
        metafunc.parametrize("comm", kinds, indirect=True)


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
    kind = _comm_kind(item)
    if kind == "sub" and not _IN_SUB:
        pytest.skip("not a member of the sub-communicator")
    marker = item.get_closest_marker("mpi")
    if marker is not None:
        need = marker.kwargs.get("min_size", marker.args[0] if marker.args else 1)
        have = COMM_SIZES[kind] if kind else SIZE
        if have < need:
            pytest.skip(f"needs at least {need} MPI ranks (running on {have})")
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
    sub = _comm_kind(item) == "sub"
    status = "failed" if report.failed else ("skipped" if report.skipped else "passed")
    if sub and not _IN_SUB:
        status = "outside"
    # the sub-communicator's test body runs on its members alone: they agree among themselves
    channel = _SUB_HARNESS if sub and call.when == "call" else _HARNESS
    statuses = [s for s in channel.allgather(status) if s != "outside"]
    failed = [r for r, s in enumerate(statuses) if s == "failed"]
    if failed and not report.failed:
        report.outcome = "failed"
        report.longrepr = (f"{call.when} failed on rank(s) {failed} of {len(statuses)}; "
                           f"see their log (MPIDIST_TEST_LOGDIR)")
    elif not failed and report.passed and "skipped" in statuses and call.when == "setup":
        # a rank-dependent skip would desynchronise the ranks: skip everywhere
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1], "skipped on another rank")
    elif failed and report.failed and len(failed) < SIZE and hasattr(report, "sections"):
        report.sections.append(("mpi", f"failed on rank(s) {failed} of {len(statuses)}"))


@pytest.fixture
def comm(request):
    """A fresh mpidist Communicator, freed after the test: a private Dup of COMM_WORLD, or
    where the test runs on every communicator (every_comm) of COMM_SELF or the sub-communicator."""
    from mpidist.comm import Communicator
    kind = getattr(request, "param", "world")
    c = Communicator({"world": None, "self": MPI.COMM_SELF, "sub": _SUB}[kind])
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
def rank(request):
    """This rank in the test's communicator (the world's where the test has no `comm`)."""
    return request.getfixturevalue("comm").rank if "comm" in request.fixturenames else RANK


@pytest.fixture
def size(request):
    """The size of the test's communicator (the world's where the test has no `comm`)."""
    return request.getfixturevalue("comm").size if "comm" in request.fixturenames else SIZE
