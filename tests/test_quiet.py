"""No noise: a job that uses one-sided windows (the shared-memory allreduce, an RMA window
with atomics) prints no MPI error line and no terminal escape sequence, under every MPI this
machine has: Open MPI 4.1 (the main environment), Open MPI 5 (the FT environment,
MPIDIST_FT_VENV) and MPICH (MPIDIST_MPICH_VENV); scripts/test.sh sets both."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = """
import numpy as np
from mpi4py import MPI
from mpidist.collectives import allreduce
from mpidist.collectives.node import SharedBuffer
from mpidist.comm import Communicator
c = Communicator()
x = np.ones(1000, np.float32)
allreduce(x, algorithm="shm", comm=c)
buf = SharedBuffer(1000, np.float32, c)
buf.data[:] = 1
buf.allreduce_async(0, 1000).wait()
buf.free()
win = MPI.Win.Allocate(64, 8, comm=c.comm)
win.Lock_all()
win.Fetch_and_op(np.ones(1, np.int64), np.zeros(1, np.int64), 0, 0, MPI.SUM)
win.Unlock_all()
win.Free()
assert x[0] == c.size
c.free()
print("OK")
"""


def _environments():
    envs = [("Open MPI (main)", os.path.dirname(os.path.dirname(sys.executable)))]
    for label, var in (("Open MPI 5 (FT environment)", "MPIDIST_FT_VENV"),
                       ("MPICH (MPICH environment)", "MPIDIST_MPICH_VENV")):
        envs.append((label, os.environ.get(var)))
    return envs


@pytest.mark.parametrize("label,venv", _environments(), ids=["main", "ompi5", "mpich"])
def test_a_window_job_prints_no_mpi_error(label, venv):
    if not venv:
        pytest.skip(f"{label} not built here (scripts/test.sh builds it)")
    python = os.path.join(venv, "bin", "python")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "OPAL_", "PMIX_", "PMI_", "PRTE_"))}
    env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env["PATH"]
    proc = subprocess.run([python, "-m", "mpidist.launcher", "-n", "2", "--", python, "-c", JOB],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "OK" in proc.stdout, (label, proc.stdout[-2000:],
                                                           proc.stderr[-3000:])
    noisy = [ln for ln in proc.stderr.splitlines() if re.search(r"\berror\b", ln, re.I)]
    assert not noisy, (label, noisy[:10])
    assert "\x1b[" not in proc.stderr + proc.stdout, (label, repr(proc.stderr[-500:]))
