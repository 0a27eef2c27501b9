"""Ending a job from one rank: the `--ft` launcher makes a rank's abort the job's end and its
exit status, however mpiexec behaves after it (mpidist.launcher._supervise), and
errors.abort_job leaves the note it reads."""
import os
import subprocess
import sys
import time

import pytest

from mpidist import launcher

pytestmark = pytest.mark.launcher          # they start processes of their own

NOTE_THEN = ("import os, sys, time\n"
             "open(os.environ['MPIDIST_ABORT_NOTE'], 'a').write('7\\n')\n"
             "time.sleep(float(sys.argv[1]))\n")


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(launcher, "ABORT_GRACE", 1.0)


def test_an_mpiexec_that_hangs_after_an_abort_is_ended_with_the_abort_code(short_grace):
    start = time.monotonic()
    assert launcher._supervise([sys.executable, "-c", NOTE_THEN, "600"], dict(os.environ)) == 7
    assert time.monotonic() - start < 30


def test_an_mpiexec_that_returns_0_after_an_abort_gives_the_abort_code(short_grace):
    assert launcher._supervise([sys.executable, "-c", NOTE_THEN, "0"], dict(os.environ)) == 7


def test_without_an_abort_the_status_is_mpiexecs(short_grace):
    assert launcher._supervise([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ)) == 3
    assert launcher._supervise([sys.executable, "-c", "pass"], dict(os.environ)) == 0


def test_abort_job_writes_its_code_where_the_launcher_reads_it(tmp_path):
    """A one-rank job: MPI_Abort(5) ends it with 5, after the note."""
    note = tmp_path / "note"
    note.write_text("")
    env = dict(launcher.without_job_variables(os.environ), MPIDIST_ABORT_NOTE=str(note))
    code = "from mpi4py import MPI\nfrom mpidist.errors import abort_job\nabort_job(MPI.COMM_WORLD, 5)\n"
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=120, capture_output=True)
    assert proc.returncode == 5 and note.read_text() == "5\n", proc.stderr[-2000:]
