"""The harness itself: deadlocks fail within the timeout; one rank's failure fails all."""
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from mpidist import launcher

HERE = os.path.dirname(os.path.abspath(__file__))


def run_pytest(tmp_path, n, body, *args, limit=120):
    """Run a throw-away test file with the real conftest under mpiexec -n n."""
    for name in ("conftest.py", "native_stacks.py"):
        shutil.copy(os.path.join(HERE, name), tmp_path / name)
    (tmp_path / "test_case.py").write_text(body)
    env = dict(os.environ, MPIDIST_TEST_LOGDIR=str(tmp_path))
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--color=no",
            str(tmp_path / "test_case.py"), *args]
    start = time.monotonic()
    proc = launcher.run(n, argv, timeout=limit, env=env, cwd=tmp_path, capture_output=True,
                        text=True)
    return proc, time.monotonic() - start


@pytest.mark.launcher
def test_deadlock_is_stopped_and_reported(tmp_path):
    body = (
        "from mpi4py import MPI\n"
        "def test_deadlock(comm):\n"
        "    if comm.rank == 0:\n"
        "        comm.comm.recv(source=1, tag=99)   # never sent: rank 0 blocks forever\n"
        "    comm.comm.Barrier()\n")
    proc, took = run_pytest(tmp_path, 2, body, "--timeout=16")
    assert proc.returncode != 0
    assert took < 70, f"deadlock not stopped in time ({took:.0f} s)"
    assert "Timeout" in proc.stdout + proc.stderr
    # before the timeout, every rank wrote where it waited, not only the first to time out
    for rank, line in ((0, 4), (1, 5)):           # rank 0 in recv, rank 1 in Barrier
        stacks = (tmp_path / f"stacks-rank{rank}.txt").read_text()
        assert stacks.startswith(f"rank {rank} of 2: test_case.py::test_deadlock still runs"), stacks
        assert f'test_case.py", line {line} in test_deadlock' in stacks, stacks
        if shutil.which("gdb"):                   # and its native frames, inside MPI
            native = (tmp_path / f"native-rank{rank}.txt").read_text()
            assert native.startswith(f"rank {rank} of 2: test_case.py::test_deadlock"), native
            assert "ptrace" in native or "PMPI_" in native, native
            assert "\ntask " in native and " wchan " in native, native   # the kernel's view


@pytest.mark.launcher
def test_a_rank_held_up_and_then_going_on_leaves_where_it_was_held(tmp_path):
    body = (
        "import time\n"
        "def test_slow_on_rank_0(comm):\n"
        "    if comm.rank == 0:\n"
        "        time.sleep(7)                       # past the stacks' time, within the timeout\n"
        "    comm.comm.Barrier()\n"
        "def test_next(comm):\n"
        "    comm.comm.Barrier()\n")
    proc, _ = run_pytest(tmp_path, 2, body, "--timeout=8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = (tmp_path / "stacks-rank0.1.txt").read_text()
    assert kept.startswith("rank 0 of 2: test_case.py::test_slow_on_rank_0 still runs"), kept
    assert 'test_case.py", line 4 in test_slow_on_rank_0' in kept, kept
    assert (tmp_path / "stacks-rank0.txt").read_text() == ""   # the session ended: emptied


@pytest.mark.launcher
def test_failure_on_one_rank_fails_everywhere(tmp_path):
    body = (
        "def test_one_rank_fails(comm):\n"
        "    assert comm.rank != 1, 'rank 1 disagrees'\n"
        "def test_all_pass(comm):\n"
        "    assert comm.comm.allreduce(1) == comm.size\n")
    proc, _ = run_pytest(tmp_path, 3, body, "-rf")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # rank 0 passed its assertion, yet reports the failure and names rank 1
    assert "failed on rank(s) [1] of 3" in proc.stdout
    assert "1 failed, 1 passed" in proc.stdout
    assert "rank 1 disagrees" in (tmp_path / "rank1.log").read_text()


@pytest.mark.launcher
def test_header_names_mpi_library_and_ranks(tmp_path):
    proc, _ = run_pytest(tmp_path, 2, "def test_ok():\n    pass\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from mpidist.comm import mpi_library
    assert f"mpi: {mpi_library()}" in proc.stdout
    assert "mpi ranks: 2" in proc.stdout


@pytest.mark.launcher
def test_comm_runs_on_world_self_and_a_sub_communicator(tmp_path):
    """Every rank goes through the same tests: the rank outside the sub-communicator skips
    its cases, its members agree on their outcome among themselves."""
    body = (
        "import pytest\n"
        "from mpi4py import MPI\n"
        "SIZES = {'world': 3, 'self': 1, 'sub': 2}\n"
        "def test_sizes(comm, size, request):\n"
        "    kind = request.node.callspec.params['comm']\n"
        "    assert comm.size == size == SIZES[kind] == comm.comm.allreduce(1)\n"
        "def test_fails_on_sub_rank_1(comm, request):\n"
        "    assert (request.node.callspec.params['comm'], comm.rank) != ('sub', 1), 'sub 1'\n"
        "@pytest.mark.world('needs the world')\n"
        "def test_world_only(comm):\n"
        "    assert comm.size == MPI.COMM_WORLD.allreduce(1) == 3\n"
        "@pytest.mark.mpi(min_size=3)\n"
        "def test_three_ranks(comm):\n"
        "    assert comm.size == 3\n")
    proc, _ = run_pytest(tmp_path, 3, body, "-o", "every_comm=test_case.py", "-v", "-rfs")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "1 failed, 7 passed, 1 skipped" in out, out
    assert "call failed on rank(s) [1] of 2" in out
    for name in ("sizes[world]", "sizes[self]", "sizes[sub]", "world_only PASSED",
                 "three_ranks[world] PASSED", "three_ranks[sub] SKIPPED"):
        assert name in out, out
    # a test that needs three ranks never runs on COMM_SELF: no such item is made
    assert "three_ranks[self]" not in out, out
    assert "test_sizes[sub] SKIPPED" in (tmp_path / "rank2.log").read_text()


@pytest.mark.launcher
def test_launcher_works_from_inside_an_mpi_job(tmp_path):
    """A job started by mpiexec may start another (nested) mpiexec through the launcher."""
    inner = "import sys; from mpi4py import MPI; sys.stdout.write(f'inner {MPI.COMM_WORLD.Get_size()}\\n')"
    outer = (f"import subprocess, sys\nfrom mpi4py import MPI\nfrom mpidist import launcher\n"
             f"r = launcher.run(2, [sys.executable, '-c', {inner!r}], timeout=120, "
             f"capture_output=True, text=True)\nprint(r.stdout, r.returncode)\n")
    script = tmp_path / "outer.py"
    script.write_text(outer)
    proc = launcher.run(1, [sys.executable, str(script)], timeout=180, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("inner 2") == 2 and proc.stdout.strip().endswith("0")


def test_single_copy_is_switched_off_only_where_the_probe_forbids_it():
    """CMA stays at Open MPI's default where a child may read its parent's memory; a value
    the user set is never overridden."""
    if launcher.mpi_vendor() != "openmpi":
        pytest.skip("the single-copy setting is Open MPI's")
    key = "OMPI_MCA_btl_vader_single_copy_mechanism"
    # as from a shell, not from inside this MPI job (whose variables a nested launch drops)
    base = {k: v for k, v in launcher.without_job_variables(os.environ).items() if k != key}
    permitted = launcher.cma_permitted()
    env = launcher.mpi_env(2, base)
    assert (env.get(key) == "none") is not permitted
    # one-sided windows take Open MPI's default component, as under a plain mpiexec
    assert "OMPI_MCA_osc" not in env
    assert launcher.mpi_env(2, {**base, key: "cma"})[key] == "cma"


@pytest.mark.launcher
def test_ranks_beyond_the_cores_sit_on_the_same_cores_in_every_launch(tmp_path):
    """More ranks than cores: each rank is bound to one core, round-robin, the same in two
    launches (which ranks share a core decides which algorithm is fastest, so a table
    tuned in one launch must hold in the next); with a core each, ranks are not bound."""
    if launcher.mpi_vendor() != "openmpi":
        pytest.skip("the binding options are Open MPI's")
    cores = os.cpu_count() or 1
    if len(os.sched_getaffinity(0)) < cores:       # e.g. under a plain `mpiexec -n 1`
        pytest.skip("this process is bound to fewer cores than the machine has")
    show = ("import json, os; from mpi4py import MPI; "
            "cpus = MPI.COMM_WORLD.gather(sorted(os.sched_getaffinity(0))); "
            "MPI.COMM_WORLD.rank or print(json.dumps(cpus))")

    def placement(n):          # each rank's cores, in rank order
        res = launcher.run(n, [sys.executable, "-c", show], timeout=120, capture_output=True,
                           text=True, env=launcher.without_job_variables(os.environ),
                           cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout.strip().splitlines()[-1])

    first = placement(cores + 1)
    assert all(len(c) == 1 for c in first), first
    assert len({c[0] for c in first}) == cores, first             # every core used
    assert placement(cores + 1) == first
    if cores > 1:
        assert all(len(c) == cores for c in placement(2)), "ranks with a core each: unbound"


@pytest.mark.launcher
def test_a_timed_out_job_leaves_no_rank_behind(tmp_path):
    """launcher.run's timeout ends every rank, even ranks that ignore SIGTERM and sit in
    process groups of their own (Open MPI), not only mpiexec."""
    token = f"mpidist-stray-{os.getpid()}"
    body = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"time.sleep(60)  # {token}")
    with pytest.raises(subprocess.TimeoutExpired):
        launcher.run(2, [sys.executable, "-c", body], timeout=3, capture_output=True,
                     env=launcher.without_job_variables(os.environ), cwd=tmp_path)
    time.sleep(1)
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and token in _cmdline(pid)]
    assert not left, f"ranks still running: {left}"


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.launcher
def test_without_ssh_open_mpi_launches_locally(tmp_path, monkeypatch):
    """Open MPI 4 refuses to start even local ranks where no ssh or rsh is on PATH
    (containers): there the launcher picks its isolated (local) launcher, and ranks start."""
    if launcher.mpi_vendor() != "openmpi":
        pytest.skip("the launcher setting is Open MPI's")
    bin_dir = tmp_path / "bin"                # Open MPI's programs, and no ssh or rsh
    bin_dir.mkdir()
    for name in ("mpiexec", "mpirun", "orterun", "orted"):
        if shutil.which(name):
            (bin_dir / name).symlink_to(shutil.which(name))
    base = {k: v for k, v in launcher.without_job_variables(os.environ).items()
            if k != "OMPI_MCA_plm"}
    base["PATH"] = str(bin_dir)
    monkeypatch.setenv("PATH", str(bin_dir))     # what the launcher's own lookups see
    assert launcher.mpi_env(2, base)["OMPI_MCA_plm"] == "isolated"
    proc = launcher.run(2, [sys.executable, "-c", "print('up')"], timeout=60, env=base,
                        capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.count("up") == 2, proc.stderr


def test_a_gdb_held_up_by_the_rank_leaves_the_kernel_view_and_says_so(tmp_path, monkeypatch):
    # a gdb that never answers stands in for one asleep on a rank's stuck memory map
    (tmp_path / "gdb").write_text("#!/bin/sh\nexec sleep 30\n")
    (tmp_path / "gdb").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    sys.path.insert(0, HERE)
    try:
        import native_stacks
    finally:
        sys.path.remove(HERE)
    monkeypatch.setattr(native_stacks, "GDB_LIMIT", 1)
    stacks, out = tmp_path / "stacks.txt", tmp_path / "native.txt"
    stacks.write_text("rank 0 of 1: held\nThread 0x1 (most recent call first):\n")
    sleeper = subprocess.Popen(["sleep", "4"])
    threading.Thread(target=sleeper.wait, daemon=True).start()   # reaped: not alive after
    native_stacks.main(sleeper.pid, str(stacks), str(out))    # returns once the rank ends
    text = out.read_text()
    assert text.startswith("rank 0 of 1: held\n") and f"\ntask {sleeper.pid} " in text
    # the stuck gdb is named, and scripts/test.sh takes it for a wedged address space
    assert text.rstrip("\n").splitlines()[-1] == native_stacks.GDB_STUCK
    script = open(os.path.join(HERE, "..", "scripts", "test.sh")).read()
    pattern = script.split("KERNEL_WEDGE='", 1)[1].split("'", 1)[0]
    assert re.search(pattern, text, re.M), (pattern, text)


def test_test_sh_finds_the_wedge_in_a_capture_larger_than_a_pipe(tmp_path):
    """scripts/test.sh's wedged(), run as the script runs it (pipefail), on captures as
    large as gdb's of a rank with many threads: it must see the wedge (a `cat | grep -q`
    did not: grep stopped at the match and cat died of SIGPIPE)."""
    script = open(os.path.join(HERE, "..", "scripts", "test.sh")).read()
    pattern = script.split("KERNEL_WEDGE='", 1)[1].split("'", 1)[0]
    func = script[script.index("wedged() {"):]
    func = func[:func.index("\n}\n") + 3]
    filler = "#1  0x00007f2451b925dd in ompi_sync_wait_mt () from libopen-pal.so.40\n" * 4000
    (tmp_path / "native-rank0.txt").write_text("loadavg: 1 1 1\n" + filler)
    (tmp_path / "native-rank1.txt").write_text(
        "task 1631 python state D wchan madvise_do_behavior\n" + filler)
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "native-rank0.txt").write_text("task 9 python state S wchan futex_do_wait\n" + filler)
    check = f"set -uo pipefail\nKERNEL_WEDGE='{pattern}'\n{func}\nwedged \"$1\"\n"
    assert subprocess.run(["bash", "-c", check, "-", str(tmp_path)]).returncode == 0
    assert subprocess.run(["bash", "-c", check, "-", str(clean)]).returncode == 1
    assert subprocess.run(["bash", "-c", check, "-", str(tmp_path / "none")]).returncode != 0
