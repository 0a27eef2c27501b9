"""The watchdog ends a job whose ranks no longer make the same calls, with the flight
recorder's account of where each rank is, instead of hanging. Each job runs under its own
mpiexec with a short MPIDIST_TIMEOUT."""
import os
import sys
import time

import pytest

from mpidist.collectives import flight
from mpidist.launcher import run, without_job_variables

SKIP = """
import sys, time
import numpy as np
from mpi4py import MPI
from mpidist.collectives import allreduce
from mpidist.comm import Communicator
c = Communicator()
x = np.ones(1000, np.float32)
calls = 5 if c.rank != c.size - 1 else 4      # the last rank runs out of data one step early
for _ in range(calls):
    allreduce(x, algorithm="ring", comm=c)
MPI.COMM_WORLD.Barrier()                      # user code: waits for the others forever
print("NOT-REACHED", flush=True)
"""


def _job(n, code, tmp_path, timeout):
    env = without_job_variables(os.environ)
    env.update(MPIDIST_TIMEOUT=str(timeout), MPIDIST_FLIGHT_DIR=str(tmp_path / "flight"))
    t0 = time.monotonic()
    res = run(n, [sys.executable, "-c", code], timeout=timeout + 60, env=env,
              capture_output=True, text=True, cwd=tmp_path)
    return res, time.monotonic() - t0


@pytest.mark.launcher
@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_skips_a_call_ends_the_job(tmp_path, n):
    timeout = 4
    res, seconds = _job(n, SKIP, tmp_path, timeout)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "NOT-REACHED" not in out, out
    assert seconds < timeout + 10 + 5, (seconds, out)     # + the job's own start-up
    waiting = "rank 0 is" if n == 2 else f"ranks 0-{n - 2} are"
    assert f"{waiting} in allreduce(n=1000, dtype=float32, op=sum, algorithm=ring) #5" in out, out
    assert f"rank {n - 1} is in no collective; the last was allreduce(" in out, out
    assert "The first call where ranks differ is #5" in out, out
    text = (tmp_path / "flight" / "diagnosis.txt").read_text()
    assert "first call where ranks differ is #5" in text
    assert len(list((tmp_path / "flight").glob("flight-rank*.json"))) == n


def test_timeout_setting():
    old = flight.get_timeout()
    try:
        flight.set_timeout(0)
        assert flight.get_timeout() == 0
        with pytest.raises(ValueError, match=">= 0"):
            flight.set_timeout(-1)
    finally:
        flight.set_timeout(old)
