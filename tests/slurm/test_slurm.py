"""The slurm/ scripts on a real single-node SLURM (Debian's slurmctld, slurmd and munge),
started by the repository's own slurm/start_local.sh. If the scheduler cannot be started the
tests fail; they skip only where nobody could start it here: as a non-root user with no
SLURM already running (start_local.sh installs packages and starts system daemons). Jobs
are short; every wait has a timeout.

Marked `launcher`: they submit jobs that start their own MPI processes, so they run once, in
the single-rank session.
"""
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from mpidist.launcher import run, without_job_variables

pytestmark = pytest.mark.launcher

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY = os.path.join("tests", "checkpoint", "toyjob.py")


def clean_env() -> dict:
    """os.environ as Python saw it at start-up, without Open MPI/PMIx variables: neither those
    of an mpiexec we run under nor those the singleton MPI_Init of this process put into the
    C environment (a job inheriting them would take its own mpiexec for part of ours)."""
    return without_job_variables(os.environ)


def sh(*argv, timeout=60, check=True):
    proc = subprocess.run(list(argv), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=clean_env())
    if check:
        assert proc.returncode == 0, f"{argv}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def scheduler():
    """Start the local SLURM with slurm/start_local.sh (idempotent); stop it afterwards if
    this fixture was the one that started it."""
    running = subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0 \
        if _have("sinfo") else False
    if not running and os.geteuid() != 0:
        pytest.skip("needs root: slurm/start_local.sh installs and starts a local SLURM as root "
                    "(or start one first)")
    proc = subprocess.run(["bash", "slurm/start_local.sh"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env=clean_env())
    assert proc.returncode == 0, f"slurm/start_local.sh failed:\n{proc.stdout}\n{proc.stderr}"
    yield
    if not running:
        subprocess.run(["bash", "slurm/stop_local.sh"], cwd=ROOT, timeout=60)


def _have(exe):
    return any(os.access(os.path.join(d, exe), os.X_OK) for d in os.environ["PATH"].split(":"))


def job(jid) -> dict:
    out = sh("scontrol", "show", "job", "-o", str(jid)).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def run_job(*args, timeout=180) -> dict:
    """sbatch and wait for the end (polling scontrol: faster than sbatch --wait's 10 s steps);
    asserts that the job completed with exit code 0."""
    jid = sh("sbatch", "--parsable", *args).stdout.strip().split(";")[0]
    try:
        info = wait_job(jid, FINAL, timeout, "the end")
    finally:
        subprocess.run(["scancel", jid], capture_output=True)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
    return info


def wait_job(jid, states, timeout, what):
    t0 = time.time()
    while True:
        info = job(jid)
        if info["JobState"] in states:
            return info
        if time.time() - t0 > timeout:
            raise AssertionError(f"job {jid} still {info['JobState']} after {timeout} s "
                                 f"(waiting for {what}); reason {info.get('Reason')}")
        time.sleep(0.3)


def test_sbatch_srun_and_mpiexec_in_an_allocation(scheduler, tmp_path):
    out = tmp_path / "wrap.out"
    run_job("-n", "2", "-O", "-o", str(out), "--wrap",
       f"srun -n 2 hostname && {sys.executable} -m mpidist.launcher -n 3 -- {sys.executable} -c "
       "'import sys; from mpi4py import MPI; sys.stdout.write(\"size %d\\n\" % MPI.COMM_WORLD.size)'")
    text = out.read_text()
    assert text.split("\n").count(os.uname().nodename) == 2, text
    assert text.count("size 3\n") == 3, text


def test_single_node_script(scheduler, tmp_path):
    log = tmp_path / "single.out"
    run_job("-n", "3", "-O", "-o", str(log), "slurm/single_node.sbatch",
            sys.executable, TOY, "--dir", str(tmp_path / "ck"), "--steps", "6",
            "--out", str(tmp_path / "out.json"))
    assert "ranks per node 3" in log.read_text()
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world_size"] == 3 and len(out["losses"]) == 6


def test_multi_node_script_launches_with_srun_pmix(scheduler, tmp_path):
    log = tmp_path / "multi.out"
    run_job("-N", "1", "--ntasks-per-node", "2", "-o", str(log),
            "slurm/multi_node.sbatch", sys.executable, TOY, "--dir", str(tmp_path / "ck"),
            "--steps", "6", "--out", str(tmp_path / "out.json"))
    assert "ranks per node 2" in log.read_text()
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world_size"] == 2 and len(out["losses"]) == 6


def test_sigkill_of_one_rank_under_srun_ends_the_step(scheduler, tmp_path):
    """No watchdog needed: PMIx reports the dead task and SLURM aborts the step."""
    t0 = time.time()
    proc = sh("srun", "--mpi=pmix", "-n", "3", "-O", sys.executable, TOY, "--dir", str(tmp_path),
              "--steps", "10", "--every", "4", "--die-rank", "1", "--die-step", "6",
              timeout=120, check=False)
    assert proc.returncode != 0 and time.time() - t0 < 60, (proc.returncode, proc.stderr[-2000:])
    assert (tmp_path / "ckpt-00000004.h5").exists()


@pytest.mark.parametrize("how", ["preemption", "notice"])
def test_preempted_job_checkpoints_requeues_and_resumes(scheduler, tmp_path, how):
    """preemption: a job in the higher-priority partition "urgent" needs the node, SLURM
    sends SIGTERM to the running job's step; notice: SIGUSR1 to the batch script (what
    --signal=B:USR1@T sends before the time limit). Either way the ranks checkpoint and exit
    75, the script requeues, the job resumes and ends on the trajectory of a run never
    interrupted."""
    ck, log = tmp_path / "ck", tmp_path / "requeue.out"
    steps = "24"
    jid = sh("sbatch", "--parsable", "-n", "2", "--exclusive", "-o", str(log),
             "slurm/requeue.sbatch", sys.executable, TOY, "--dir", str(ck), "--steps", steps,
             "--every", "5", "--sleep", "0.25", "--out", str(tmp_path / "out.json")).stdout.strip()
    urgent = None
    try:
        t0 = time.time()
        while not (ck / "ckpt-00000005.h5").exists():
            assert time.time() - t0 < 120, f"no checkpoint yet:\n{log.read_text() if log.exists() else ''}"
            time.sleep(0.2)
        if how == "preemption":
            urgent = sh("sbatch", "--parsable", "-p", "urgent", "-n", "1", "-o",
                        str(tmp_path / "urgent.out"), "--wrap", "echo urgent ran").stdout.strip()
        else:
            sh("scancel", "--batch", "--signal=USR1", jid)
        info = wait_job(jid, ("PENDING",), 90, "the requeue")
        assert info["Restarts"] == "1"
        # SLURM holds a requeued job ~2 minutes (BeginTime); release it (after the second in
        # which the old credential was revoked, or slurmd refuses the launch)
        time.sleep(2)
        sh("scontrol", "update", f"JobId={jid}", "StartTime=now")
        info = wait_job(jid, FINAL, 180, "the end")
        text = log.read_text()
        assert info["JobState"] == "COMPLETED", text
    finally:
        subprocess.run(["scancel", jid] + ([urgent] if urgent else []), capture_output=True)
    if urgent:
        assert wait_job(urgent, FINAL, 60, "the urgent job")["JobState"] == "COMPLETED"
    notes = "".join(p.read_text() for p in sorted(ck.glob("preempted.*")))
    preempted = re.findall(r"rank (\d+): preempted by signal (\S+), checkpoint at step (\d+)", notes)
    assert sorted(r for r, _, _ in preempted) == ["0", "1"], text
    assert {sig for _, sig, _ in preempted} == {"15" if how == "preemption" else "10"}
    assert "requeueing job" in text and "restart 1" in text, text
    out = json.loads((tmp_path / "out.json").read_text())
    stop = int(preempted[0][2])
    assert out["restart"] == "1" and out["resumed_from"]["step"] == stop
    ref = tmp_path / "ref"
    argv = [sys.executable, TOY, "--dir", str(ref), "--steps", steps, "--out", str(ref / "out.json")]
    proc = run(2, argv, timeout=120, env=clean_env(), cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    want = json.loads((ref / "out.json").read_text())
    np.testing.assert_allclose(out["losses"], want["losses"], rtol=1e-6, atol=0)
    np.testing.assert_allclose(out["w"], want["w"], rtol=0, atol=1e-6)


def test_bench_sweep_as_job_array(scheduler, tmp_path):
    log = tmp_path / "array-%a.out"
    jid = sh("sbatch", "--parsable", "--array=1-2", "-n", "2", "-O", "-o", str(log),
             f"--export=ALL,MPIDIST_BENCH_OUT={tmp_path}", "slurm/bench_array.sbatch",
             "checkpoint", "--size-mb", "4", "--repeat", "1").stdout.strip()
    for task in (1, 2):
        info = wait_job(f"{jid}_{task}", FINAL, 240, f"array task {task}")
        assert info["JobState"] == "COMPLETED", info
    for n in (1, 2):
        found = list(tmp_path.glob(f"checkpoint/array-*/ranks-{n}/checkpoint.json"))
        assert len(found) == 1, sorted(str(p) for p in tmp_path.rglob("*"))
        assert json.loads(found[0].read_text())["ranks"] == n


def test_doctor_under_srun(scheduler, tmp_path):
    """`srun --mpi=none` starts unwired tasks: the doctor fails on each, saying what to use;
    `srun --mpi=pmix` forms one job, which the doctor passes."""
    doc = [sys.executable, "-m", "mpidist", "doctor"]
    bad = sh("srun", "--mpi=none", "-n", "2", "-O", *doc, timeout=120, check=False)
    assert bad.returncode != 0, bad.stdout + bad.stderr
    assert bad.stdout.count("[FAIL] job") == 2 and "srun --mpi=pmix" in bad.stdout, bad.stdout
    good = sh("srun", "--mpi=pmix", "-n", "2", "-O", *doc, timeout=120)
    assert "2 ranks in one MPI job" in good.stdout and "[FAIL]" not in good.stdout, good.stdout
