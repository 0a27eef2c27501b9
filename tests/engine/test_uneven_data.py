"""Ranks that see datasets of different sizes (node-local copies that differ; here a relative
[data] path read from two working directories) would run different numbers of steps and hang
in the last collective: `mpidist train` stops at once, on every rank, saying why."""
import os
import subprocess
import sys

import pytest

from mpidist.data.importers import make_synthetic
from mpidist.launcher import _end_session, mpi_env, mpiexec_argv, without_job_variables

pytestmark = pytest.mark.launcher

JOB = """
[job]
name = "uneven"
epochs = 1
progress = false
plot = false
out_dir = "run"
[model]
name = "mlp"
hidden = [16]
[data]
dataset = "hdf5"
path = "data.h5"
batch_size = 32
[parallel]
strategy = "dp"
"""


def test_uneven_data_stops_with_a_clear_error(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    dirs = []
    for name, samples in (("a", 400), ("b", 360)):
        d = tmp_path / name
        d.mkdir()
        make_synthetic(str(d / "data.h5"), samples=samples, features=8, classes=3)
        dirs.append(d)
    # MPMD: one rank in each directory, one job
    cmd = mpiexec_argv(1, ["-wdir", str(dirs[0]), sys.executable, "-m", "mpidist", "train", str(job)])
    cmd += [":", "-n", "1", "-wdir", str(dirs[1]), sys.executable, "-m", "mpidist", "train", str(job)]
    env = mpi_env(2, without_job_variables(os.environ))
    env["MPIDIST_TIMEOUT"] = "60"
    with subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            _end_session(proc)
            raise
    assert proc.returncode != 0, out
    # raised on both ranks; the first to fail may end the job before the other prints
    assert "the dataset file's size in bytes differs across ranks (ranks 0: " in out, out
    assert "every rank must read the same dataset" in out, out
