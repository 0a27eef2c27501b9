"""The parameter server under a plain `mpiexec`, with no mpidist (or Open MPI) settings in the
environment: what a user on a cluster or a laptop runs. Open MPI 4.x then gives one-sided
windows to osc/rdma, whose 64-bit MPI_Compare_and_swap crashed the server: the server's
protocol uses only Fetch_and_op and Accumulate."""
import os
import subprocess
import sys

import pytest

from mpidist.launcher import _end_session, mpi_vendor, without_job_variables

pytestmark = pytest.mark.launcher

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plain_mpiexec(n, argv, cwd, timeout=300):
    """mpiexec -n n argv, flags only where Open MPI needs them to start at all here (root,
    more ranks than cores); no OMPI_MCA_ or MPIDIST_ variable in the environment."""
    env = {k: v for k, v in without_job_variables(os.environ).items()
           if not k.startswith(("OMPI_", "MPIDIST_"))}
    cmd = ["mpiexec"]
    if mpi_vendor() == "openmpi":
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    with subprocess.Popen(cmd + ["-n", str(n)] + argv, env=env, cwd=cwd, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end_session(proc)
            raise
    return proc.returncode, out


def test_ps_job_under_plain_mpiexec(tmp_path):
    """The SSP job, whole, with its own accuracy target."""
    cfg = tmp_path / "ps.toml"
    cfg.write_text(open(os.path.join(ROOT, "jobs", "digits_ps_ssp.toml")).read())
    rc, out = _plain_mpiexec(4, [sys.executable, "-m", "mpidist", "train", str(cfg),
                                 "--set", f"job.out_dir={tmp_path / 'run'}", "--set", "job.progress=false", "--set", "job.plot=false"], tmp_path)
    assert rc == 0, out
    assert "Segmentation fault" not in out and "test accuracy" in out, out
    assert (tmp_path / "run" / "summary.json").exists()
