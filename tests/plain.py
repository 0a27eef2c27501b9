"""A plain `mpiexec`, as a user on a laptop or a cluster runs it: no mpidist, Open MPI, job
or thread-count variables in the environment, flags only where Open MPI needs them to start
at all here (root, more ranks than cores), plus the caller's own (a binding, say)."""
import os
import subprocess

from mpidist.launcher import _end_session, mpi_vendor, without_job_variables


THREAD_COUNTS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def plain_mpiexec(n, argv, cwd, timeout=300, flags=()):
    """(returncode, output) of mpiexec [flags] -n n argv; the whole session ends on timeout."""
    env = {k: v for k, v in without_job_variables(os.environ).items()
           if not k.startswith(("OMPI_", "MPIDIST_")) and k not in THREAD_COUNTS}
    cmd = ["mpiexec"]
    if mpi_vendor() == "openmpi":
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    with subprocess.Popen(cmd + list(flags) + ["-n", str(n)] + list(argv), env=env, cwd=cwd,
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end_session(proc)
            raise
    return proc.returncode, out
