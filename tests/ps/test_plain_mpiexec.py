"""The parameter server under a plain `mpiexec`, with no mpidist (or Open MPI) settings in the
environment: what a user on a cluster or a laptop runs. Open MPI 4.x then gives one-sided
windows to osc/rdma, whose 64-bit MPI_Compare_and_swap crashed the server: the server's
protocol uses only Fetch_and_op and Accumulate."""
import os
import sys

import pytest

from tests.plain import plain_mpiexec

pytestmark = pytest.mark.launcher

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ps_job_under_plain_mpiexec(tmp_path):
    """The SSP job, whole, with its own accuracy target."""
    cfg = tmp_path / "ps.toml"
    cfg.write_text(open(os.path.join(ROOT, "jobs", "digits_ps_ssp.toml")).read())
    rc, out = plain_mpiexec(4, [sys.executable, "-m", "mpidist", "train", str(cfg),
                                 "--set", f"job.out_dir={tmp_path / 'run'}", "--set", "job.progress=false", "--set", "job.plot=false"], tmp_path)
    assert rc == 0, out
    assert "Segmentation fault" not in out and "test accuracy" in out, out
    assert (tmp_path / "run" / "summary.json").exists()
