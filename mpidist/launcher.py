"""The one place that knows how to start MPI ranks on this kind of machine.

Open MPI as root needs OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM); more ranks than cores needs
oversubscription, which also makes idle ranks yield the core instead of busy-polling, and
binds the ranks round-robin to the cores (the same placement in every launch). Open
MPI's single-copy transport between ranks of a node (CMA, process_vm_readv) is left on where
this machine permits it and switched off where a container forbids it, which a quick probe
decides: without it every large message is copied twice through shared fragments and moves
only while both ends are inside MPI. Each rank gets one BLAS thread and a fair share of Numba
threads. Other MPI libraries get a plain `mpiexec -n N`. What each setting buys:
docs/PERFORMANCE.md; how to launch: docs/LAUNCHING.md.

    python -m mpidist.launcher -n 4 -- python -m pytest tests
    python -m mpidist.launcher -n 4 -- mpidist train jobs/digits_lamb.toml
    python -m mpidist.launcher --ft -n 4 -- mpidist train JOB   (ULFM: from the FT environment)
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

__all__ = ["cma_permitted", "ft_supported", "unwired_launch", "mpiexec_argv", "mpi_env", "mpi_vendor",
           "remote_launch", "REMOTE_LAUNCH", "run", "main"]


@functools.lru_cache(maxsize=None)
def _mpiexec() -> str:
    exe = os.environ.get("MPIEXEC") or shutil.which("mpiexec") or shutil.which("mpirun")
    if not exe:
        raise RuntimeError("mpiexec not found: install Open MPI (apt-get install openmpi-bin) "
                           "or load your site's MPI module")
    return exe


@functools.lru_cache(maxsize=None)
def mpi_vendor() -> str:
    """'openmpi', 'mpich' or 'other', from `mpiexec --version`."""
    try:
        out = subprocess.run([_mpiexec(), "--version"], capture_output=True, text=True,
                             timeout=30).stdout + ""
    except (OSError, subprocess.TimeoutExpired):
        return "other"
    low = out.lower()
    if "open mpi" in low or "open-rte" in low or "openrte" in low:
        return "openmpi"
    if "hydra" in low or "mpich" in low:
        return "mpich"
    return "other"


@functools.lru_cache(maxsize=None)
def ft_supported() -> bool:
    """Whether the MPI beside mpiexec has ULFM fault tolerance (its ompi_info says
    "FT MPI support: yes": the PyPI Open MPI 5 wheel does, Debian's Open MPI 4.1 does not)."""
    info = os.path.join(os.path.dirname(os.path.realpath(_mpiexec())), "ompi_info")
    try:
        out = subprocess.run([info], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "FT MPI support: yes" in out


def _cma_probe() -> bool:
    """In a fresh process: can a child read its parent's memory with process_vm_readv?

    That is the permission Open MPI's CMA single copy needs between ranks (reading a parent
    is refused under the stricter ptrace rules too, so the answer errs towards "no")."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "process_vm_readv"):
        return False

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    source = ctypes.create_string_buffer(b"mpidist", 8)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        target = ctypes.create_string_buffer(8)
        local = IoVec(ctypes.addressof(target), 8)
        remote = IoVec(ctypes.addressof(source), 8)
        got = libc.process_vm_readv(parent, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        os._exit(0 if got == 8 and target.value == b"mpidist" else 1)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status) == 0


@functools.lru_cache(maxsize=None)
def cma_permitted() -> bool:
    """Whether ranks on this machine may use cross-memory attach (probed in a child
    interpreter, never forking a process that may have started MPI)."""
    if not sys.platform.startswith("linux"):
        return False
    probe = "import sys; from mpidist.launcher import _cma_probe; sys.exit(0 if _cma_probe() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def unwired_launch(env: dict | None = None) -> str | None:
    """Why this process, started as one task of several by srun, would not join the others
    in one MPI job, or None. srun without a PMI plugin (`--mpi=none`, or a default of none)
    gives the tasks no process-manager wiring: each MPI then fails to start or runs alone."""
    env = os.environ if env is None else env
    tasks = env.get("SLURM_STEP_NUM_TASKS") or "1"         # an srun step's, not a batch script's
    wired = any(env.get(v) for v in ("PMIX_RANK", "PMI_RANK", "PMI_FD", "OMPI_COMM_WORLD_RANK",
                                     "PMI_ID", "MPI_LOCALRANKID"))
    if not env.get("SLURM_PROCID") or wired or not tasks.isdigit() or int(tasks) < 2:
        return None
    return (f"srun started {tasks} tasks without a PMI plugin: each would be an MPI job of its "
            f"own (or fail in MPI_Init). Use `srun --mpi=pmix` (or pmi2; `srun --mpi=list` shows "
            f"them, MpiDefault in slurm.conf sets one), or `mpirun` inside the allocation")


def _oversubscribed(n: int) -> bool:
    """More ranks than cores: the ranks then yield when idle and are bound round-robin."""
    return int(n) > (os.cpu_count() or 1)


def without_job_variables(env: dict) -> dict:
    """env less the MPI job's wiring (OMPI_, OPAL_, PMIX_, PMI_ variables, and the launcher's
    MPIDIST_ABORT_NOTE): as from a shell."""
    return {k: v for k, v in env.items()
            if not k.startswith(("OMPI_", "OPAL_", "PMIX_", "PMI_")) and k != "MPIDIST_ABORT_NOTE"}


def mpi_env(n: int = 1, base: dict | None = None, ft: bool = False) -> dict:
    """Environment for n ranks on this machine (copies `base`, default os.environ).

    ft: for a job under ULFM: mpi4py's reductions of Python objects go point to point over a
    hidden duplicate communicator, which revoking the communicator does not reach (a rank
    waiting there for a survivor that left would never return); MPI4PY_RC_FAST_REDUCE=0
    makes them MPI collectives on the communicator itself."""
    env = dict(os.environ if base is None else base)
    if ft:
        env.setdefault("MPI4PY_RC_FAST_REDUCE", "0")
    if any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK")):
        # started from inside an MPI job: the parent's wiring would make a nested mpiexec fail
        env = without_job_variables(env)
    cores = os.cpu_count() or 1
    if mpi_vendor() == "openmpi":
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        if _oversubscribed(n):
            # more ranks than cores: a rank waiting for a message gives its core away (with a
            # core each, polling answers in a microsecond where yielding takes tens)
            env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
        env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
        if not (shutil.which("ssh") or shutil.which("rsh")):
            # the ranks are local, but Open MPI 4's rsh launcher refuses to start without an
            # ssh or rsh on PATH (containers): its isolated launcher needs neither
            env.setdefault("OMPI_MCA_plm", "isolated")
        if not cma_permitted():       # a container forbids ptrace-based single copy
            env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    env.setdefault("NUMBA_NUM_THREADS", str(max(1, cores // max(1, n))))
    env.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "mpidist",
                                                   "numba"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def mpiexec_argv(n: int, argv: list[str], ft: bool = False) -> list[str]:
    """The mpiexec command line that starts `argv` on n local ranks (ft: with MPI's
    fault-tolerance extension on, `--with-ft ulfm`, which Open MPI 5 has)."""
    if int(n) < 1:
        raise ValueError(f"number of ranks must be >= 1, got {n}")
    cmd = [_mpiexec()]
    if mpi_vendor() == "openmpi":
        # more ranks than cores: ranks go round-robin onto the cores and stay there, so which
        # ranks share a core (it decides which algorithm is fastest for large messages) is the
        # same in every launch, for `mpidist tune` and for the job that reads its table
        bind = ["--map-by", "core", "--bind-to", "core:overload-allowed"] \
            if _oversubscribed(n) else ["--bind-to", "none"]
        cmd += ["--oversubscribe", *bind]
    if ft:
        cmd += ["--with-ft", "ulfm"]
    return cmd + ["-n", str(int(n))] + list(argv)


# How each MPI's mpiexec starts ranks on other hosts, given as "address:slots" (block
# placement), through an agent (a command run where ssh would be), with the traffic between
# hosts kept on one interface: flags before -n, and environment. MPICH's UCX may use TCP
# only: its shared memory would join hosts that share a machine (network namespaces).
REMOTE_LAUNCH = {
    "openmpi": (lambda hosts, agent, nic: ["--host", hosts, "--map-by", "slot"],
                lambda agent, nic, subnet: {
                    "OMPI_MCA_plm": "rsh", "OMPI_MCA_plm_rsh_agent": agent,
                    "OMPI_MCA_plm_rsh_no_tree_spawn": "1", "OMPI_MCA_pml": "ob1",
                    "OMPI_MCA_btl": "self,vader,tcp", "OMPI_MCA_btl_tcp_if_include": subnet,
                    "OMPI_MCA_oob_tcp_if_include": subnet, "OMPI_MCA_osc": "sm,pt2pt"}),
    "mpich": (lambda hosts, agent, nic: ["-hosts", hosts, "-launcher", "ssh", "-launcher-exec",
                                         agent, "-iface", nic],
              lambda agent, nic, subnet: {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": nic,
                                          "FI_PROVIDER": "tcp", "FI_TCP_IFACE": nic}),
}


def remote_launch(hosts: list[tuple[str, int]], agent: str, nic: str,
                  subnet: str) -> tuple[list[str], dict]:
    """(mpiexec flags before -n, environment) that start ranks on hosts [(address, ranks)]
    through agent, talking between hosts over interface nic (its subnet, a.b.c.d/n)."""
    vendor = mpi_vendor()
    if vendor not in REMOTE_LAUNCH:
        raise RuntimeError(f"starting ranks on other hosts needs Open MPI's or MPICH's "
                           f"mpiexec; {_mpiexec()} is neither")
    flags, env = REMOTE_LAUNCH[vendor]
    return flags(",".join(f"{a}:{n}" for a, n in hosts), agent, nic), env(agent, nic, subnet)


def run(n: int, argv: list[str], timeout: float | None = None, ft: bool = False,
        **kwargs) -> subprocess.CompletedProcess:
    """Run argv on n ranks and wait, like subprocess.run (env: the base of mpi_env).

    The job runs in a session of its own: after `timeout` seconds, or on an interrupt, the
    whole session is ended (_end_session: mpiexec and every rank), not only mpiexec, whose
    ranks would otherwise keep running; then TimeoutExpired (or the interrupt) is raised."""
    env = mpi_env(n, kwargs.pop("env", None), ft=ft)
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with subprocess.Popen(mpiexec_argv(n, argv, ft), env=env, start_new_session=True,
                          **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            _end_session(proc)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _end_session(proc: subprocess.Popen) -> None:
    """End a job started in a session of its own: SIGTERM to mpiexec (which ends its ranks),
    then SIGKILL to whatever of the session is left, ranks included (Open MPI puts each
    rank in a process group of its own, so killing mpiexec's group would miss them)."""
    proc.terminate()
    try:
        proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for pid in _session_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.communicate()


def _session_members(sid: int) -> list[int]:
    """Pids of the processes in session sid (from /proc; just sid where there is none)."""
    if not os.path.isdir("/proc"):
        return [sid]
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()    # state ppid pgrp session ...
            if int(fields[3]) == sid:
                found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def main(argv: list[str] | None = None) -> int:
    """`python -m mpidist.launcher -n N -- CMD`: run CMD on N local ranks; returns its exit code."""
    parser = argparse.ArgumentParser(prog="python -m mpidist.launcher",
                                     description="Start a command on N local MPI ranks.")
    parser.add_argument("-n", "--np", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--env-only", action="store_true",
                        help="run the command once, without mpiexec, in the same environment")
    parser.add_argument("--ft", action="store_true",
                        help="MPI fault tolerance on (mpiexec --with-ft ulfm), for [job] fault_tolerance; "
                             "needs Open MPI 5: the environment of MPIDIST_MPI=ompi5-ft scripts/setup_env.sh")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if args.env_only:
        os.execvpe(command[0], command, mpi_env(1))
    if args.ft and not ft_supported():
        parser.error(f"--ft needs an MPI with fault tolerance (ULFM); {_mpiexec()} has none. Build the "
                     "FT environment with `MPIDIST_MPI=ompi5-ft bash scripts/setup_env.sh` and run "
                     "from it (source <its path>/bin/activate)")
    cmd = mpiexec_argv(args.np, command, ft=args.ft)
    if args.ft:
        return _supervise(cmd, mpi_env(args.np, ft=True))
    os.execvpe(cmd[0], cmd, mpi_env(args.np, ft=args.ft))


ABORT_GRACE = 10.0     # seconds mpiexec gets to end the job once a rank has aborted it


def _supervise(cmd: list[str], env: dict) -> int:
    """Run mpiexec as a child and return the job's exit status (`--ft`).

    With ULFM on, Open MPI 5's mpiexec sometimes never returns after a rank's MPI_Abort,
    with every rank gone, or returns 0 from it. A rank that aborts the job
    (errors.abort_job) first writes its exit code to the file MPIDIST_ABORT_NOTE names;
    once it has, mpiexec gets ABORT_GRACE seconds before its session is ended, and the job
    ends with that code. Signals to the launcher go on to mpiexec."""
    fd, note = tempfile.mkstemp(prefix="mpidist-abort-")
    os.close(fd)
    proc = subprocess.Popen(cmd, env=dict(env, MPIDIST_ABORT_NOTE=note), start_new_session=True)
    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
    before = {sig: signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
              for sig in forwarded}
    aborted = None
    try:
        while proc.poll() is None:
            time.sleep(0.2)
            if aborted is None and os.path.getsize(note):
                aborted = time.monotonic()
            if aborted is not None and time.monotonic() - aborted > ABORT_GRACE:
                print(f"mpidist launcher: mpiexec had not ended {ABORT_GRACE:g} s after a rank "
                      "aborted the job; ending it", file=sys.stderr, flush=True)
                _end_session(proc)
        with open(note) as fh:
            codes = [int(line) for line in fh if line.strip().lstrip("-").isdigit()]
    finally:
        os.unlink(note)
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return next((c for c in codes if c), 1) if codes else proc.returncode


if __name__ == "__main__":
    sys.exit(main())
