"""Shrink-and-continue: the main job (jobs/digits_lamb.toml) on 4 ranks (diloco and local_sgd:
3 and 4) under `mpiexec --with-ft ulfm` from the FT environment, with ranks SIGKILLed at
random steps.

Each test starts its own jobs (marked `launcher`: run once, in the one-rank session) with the
FT environment's Python (MPIDIST_FT_VENV, else built by `MPIDIST_MPI=ompi5-ft bash
scripts/setup_env.sh`; the tests skip, saying why, only where it cannot be built).
"""
import json
import math
import os
import random
import signal
import subprocess
import time

import pytest

from mpidist.launcher import without_job_variables

pytestmark = pytest.mark.launcher

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
JOB = os.path.join(HERE, "_job.py")
MAIN = os.path.join(ROOT, "jobs", "digits_lamb.toml")
TOTAL = 132             # the main job's steps: 12 epochs of 1438 // 128 + 1 batches
RECOVERY_S = 15.0       # failure to the next completed step
ACCURACY_PP = 0.005     # final test accuracy within 0.5 pp of the uninterrupted run


@pytest.fixture(scope="module")
def ft_python():
    """The FT environment's python (built once, cached by scripts/setup_env.sh)."""
    venv = os.environ.get("MPIDIST_FT_VENV")
    if not venv:
        env = {**os.environ, "MPIDIST_MPI": "ompi5-ft"}
        try:
            proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup_env.sh")], env=env,
                                  capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            pytest.skip("the FT environment (MPIDIST_MPI=ompi5-ft scripts/setup_env.sh) took over 900 s to build")
        if proc.returncode != 0 or not proc.stdout.strip():
            pytest.skip("the FT environment (Open MPI 5 wheel with ULFM) cannot be built here: "
                        + (proc.stderr.strip().splitlines() or ["no output"])[-1])
        venv = proc.stdout.strip().splitlines()[-1]
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        pytest.skip(f"MPIDIST_FT_VENV={venv} has no bin/python")
    return python


def train(ft_python, out, *, kill="", kill_in_checkpoint="", sets=(), ft=True, timeout=400, n=4):
    """The main job on n ranks under --with-ft ulfm; ranks die as `kill` ("RANK@STEP,...":
    MPIDIST_FT_KILL) and `kill_in_checkpoint` (_job.py) say."""
    args = [ft_python, "-m", "mpidist.launcher", "--ft", "-n", str(n), "--", ft_python, JOB, MAIN,
            "--out", str(out), "--set", "job.progress=false", "--set", "job.plot=false"]
    if ft:
        args += ["--set", "job.fault_tolerance='shrink'"]
    for s in sets:
        args += ["--set", s]
    env = without_job_variables(os.environ)
    env["PATH"] = os.path.dirname(ft_python) + os.pathsep + env.get("PATH", "")
    env["MPIDIST_FT_KILL"] = kill
    env["MPIDIST_TEST_CKPT_KILL"] = kill_in_checkpoint
    env.pop("MPIDIST_TIMEOUT", None)
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)       # mpiexec ends its ranks
        try:
            log, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
        pytest.fail(f"the job (kill={kill!r}) did not end within {timeout} s:\n{log[-4000:]}")
    return proc.returncode, log


def summary_of(out, rc, log, what):
    assert rc == 0, f"{what}: exit {rc}\n{log[-4000:]}"
    with open(os.path.join(out, "summary.json")) as fh:
        return json.load(fh)


def killed_at(out, rank):
    with open(os.path.join(out, f"killed-rank{rank}.txt")) as fh:
        return float(fh.read())


@pytest.fixture(scope="module")
def baseline(ft_python, tmp_path_factory):
    """The uninterrupted run, fault tolerance on: its final test accuracy."""
    out = tmp_path_factory.mktemp("baseline")
    rc, log = train(ft_python, out)
    s = summary_of(out, rc, log, "uninterrupted run")
    assert s["ranks"] == 4 and s["steps"] == TOTAL and s["recoveries"] == []
    return s["test_accuracy"]


def check_recovered(out, rc, log, baseline, lost: list[list[int]], what, merged=False):
    """The job finished on the survivors, each recovery recorded and quick, accuracy kept.
    merged: the failures were apart in time, but one recovery may find several of them (a
    second rank can die before the first failure is detected): the protocol guarantees
    every lost rank is dropped, in the order they died, not how detection groups them."""
    s = summary_of(out, rc, log, what)
    recs = s["recoveries"]
    got = [r["lost_ranks"] for r in recs]
    if merged:
        flat = [r for group in got for r in sorted(group, key=[x for g in lost for x in g].index)]
        assert flat == [r for group in lost for r in group] and all(got), (what, recs)
        lost = got
    assert got == lost, (what, recs)
    n = 4 - sum(len(x) for x in lost)
    assert s["ranks"] == n and recs[-1]["new_size"] == n, (what, s["ranks"], recs)
    assert s["steps"] == TOTAL, (what, s["steps"])
    for rec, ranks in zip(recs, lost):
        assert rec["seconds"] < RECOVERY_S, (what, rec)
        since_kill = rec["done_at"] - min(killed_at(out, r) for r in ranks)
        assert since_kill < RECOVERY_S, (what, f"{since_kill:.1f} s from the kill to the next step", rec)
        assert 0 <= rec["steps_redone"] <= rec["step"], (what, rec)
    assert "recovered: lost rank(s)" in log, what
    assert abs(s["test_accuracy"] - baseline) <= ACCURACY_PP, (what, s["test_accuracy"], baseline)
    return recs


@pytest.mark.timeout(900)
def test_one_rank_killed_at_a_random_step(ft_python, baseline, tmp_path):
    rank, step = random.randrange(1, 4), random.randrange(5, TOTAL - 10)
    what = f"rank {rank} killed after step {step}"
    rc, log = train(ft_python, tmp_path, kill=f"{rank}@{step}")
    recs = check_recovered(tmp_path, rc, log, baseline, [[rank]], what)
    assert recs[0]["restored_from"] == "replica" and recs[0]["steps_redone"] == 0, (what, recs)


@pytest.mark.timeout(600)
def test_rank_0_then_another_rank_killed(ft_python, baseline, tmp_path):
    """Two successive failures, the first of rank 0: metrics and checkpoints move to the new
    rank 0 (old rank 1), and then to the next one if that one dies too."""
    first = random.randrange(5, 60)
    second, other = random.randrange(first + 5, TOTAL - 10), random.randrange(1, 4)
    what = f"rank 0 killed after step {first}, rank {other} after step {second}"
    rc, log = train(ft_python, tmp_path, kill=f"0@{first},{other}@{second}")
    recs = check_recovered(tmp_path, rc, log, baseline, [[0], [other]], what, merged=True)
    steps = [json.loads(line).get("step") for line in open(tmp_path / "metrics.jsonl")
             if '"event": "step"' in line]
    # a step that completed inside the optimizer's last collective on some survivors when rank
    # 0 died has no metrics line anywhere (known limit): only such steps may be missing, the
    # one after a kill or the one a recovery happened in
    missing = set(range(1, TOTAL + 1)) - set(steps)
    allowed = {first + 1, second + 1} | {r["step"] + d for r in recs for d in (0, 1)}
    assert missing <= allowed, (what, "metrics lost steps", sorted(missing), recs)
    assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == f"ckpt-{TOTAL:08d}.h5", what


@pytest.mark.timeout(600)
def test_a_failure_while_recovering_is_recovered_too(ft_python, baseline, tmp_path):
    step = random.randrange(5, TOTAL - 10)
    what = f"rank 3 killed after step {step}, rank 1 in the recovery that follows"
    rc, log = train(ft_python, tmp_path, kill=f"3@{step},1@recovery")
    check_recovered(tmp_path, rc, log, baseline, [[1, 3]], what)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("route", ["neighbour", "checkpoint"])
def test_zero2_restores_the_lost_shard(ft_python, baseline, tmp_path, route):
    rank, step = random.randrange(0, 4), random.randrange(55, TOTAL - 10)
    what = f"zero-2 ({route}): rank {rank} killed after step {step}"
    rc, log = train(ft_python, tmp_path, kill=f"{rank}@{step}",
                       sets=("parallel.strategy='zero'", "parallel.stage=2", f"job.shard_restore='{route}'"))
    recs = check_recovered(tmp_path, rc, log, baseline, [[rank]], what)
    assert recs[0]["restored_from"] == route, (what, recs)
    if route == "checkpoint":       # from a checkpoint before the failure (interval 50; the
        # newest one, unless the kill cut its write short)
        assert recs[0]["resumed_from"] % 50 == 0, (what, recs)
        assert 0 <= recs[0]["step"] - recs[0]["resumed_from"] < 100, (what, recs)
    else:               # one step when the kill cut the copy of the step before short
        assert recs[0]["steps_redone"] <= 1, (what, recs)


@pytest.mark.timeout(600)
def test_failure_inside_a_checkpoint_write_keeps_the_previous_one(ft_python, baseline, tmp_path):
    what = "rank 2 killed with the checkpoint of step 100 open"
    rc, log = train(ft_python, tmp_path, kill_in_checkpoint="2@100", sets=("checkpoint.keep=3",))
    check_recovered(tmp_path, rc, log, baseline, [[2]], what)
    # 50 kept, 100 never renamed into place, written again by the survivors at the next step
    files = sorted(os.listdir(tmp_path / "checkpoints"))
    assert files == ["ckpt-00000050.h5", "ckpt-00000101.h5", f"ckpt-{TOTAL:08d}.h5"], (what, files)
    # both open and verify (whole-tensor checksums), in the FT environment's h5py
    check = ("import sys; from mpidist.checkpoint.reader import CheckpointReader\n"
             "for p in sys.argv[1:]:\n    with CheckpointReader(p, verify=True):\n        pass")
    paths = [str(tmp_path / "checkpoints" / f) for f in files]
    proc = subprocess.run([ft_python, "-c", check, *paths], capture_output=True, text=True, timeout=120,
                          env=without_job_variables(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.timeout(300)
def test_without_fault_tolerance_a_lost_rank_ends_the_job(ft_python, tmp_path):
    rc, log = train(ft_python, tmp_path, kill_in_checkpoint="2@50", ft=False, timeout=200)
    ended = time.time() - killed_at(tmp_path, 2)
    assert rc != 0, log[-3000:]
    assert not (tmp_path / "summary.json").exists()
    assert ended < 30, f"the job took {ended:.1f} s to end after the kill\n{log[-3000:]}"


DILOCO_STEPS, H = 96, 32


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy, n, group_size, killed", [("diloco", 3, 1, 2), ("local_sgd", 4, 2, 1)])
def test_diloco_drops_a_lost_group_and_the_others_go_on(ft_python, tmp_path, strategy, n, group_size, killed):
    """DiLoCo / local SGD, a rank killed mid-round: a group of one (diloco) is dropped, the
    survivor of a group of two (local_sgd) carries its group on; the other groups keep their
    round's progress and the job ends on the survivors (tests/ft/test_diloco.py checks the
    state they keep and the next outer step's weights)."""
    step = random.randrange(H + 2, H + 8)     # early in the second round (a step takes ms: the
    # kill, 0-50 ms into the next step, lands some steps later)
    what = f"{strategy}, groups of {group_size} on {n} ranks: rank {killed} killed after step {step}"
    rc, log = train(ft_python, tmp_path, kill=f"{killed}@{step}", n=n, sets=(
        f"parallel.strategy='{strategy}'", f"parallel.group_size={group_size}", f"parallel.sync_every={H}",
        f"job.steps={DILOCO_STEPS}", "job.eval_every=24", "checkpoint.interval=0", "job.target_accuracy=0.9"))
    s = summary_of(tmp_path, rc, log, what)
    (rec,) = s["recoveries"]
    groups = -(-n // group_size)
    assert (s["steps"], s["ranks"], rec["lost_ranks"], rec["new_size"]) == (DILOCO_STEPS, n - 1, [killed], n - 1), \
        (what, s)
    assert rec["restored_from"] == "groups" and rec["steps_redone"] == 0, (what, rec)
    whole = group_size == 1           # the killed rank was its group's only one
    assert rec["dropped_groups"] == ([killed // group_size] if whole else []), (what, rec)
    assert rec["groups"] == groups - whole and len(rec["inner_steps"]) == rec["groups"], (what, rec)
    # mid-round, every group kept the inner state it had reached (one step either side)
    assert H < rec["step"] < 2 * H, (what, "the failure missed the second round", rec)
    assert all(abs(k - rec["step"]) <= 1 for k in rec["inner_steps"]), (what, rec)
    assert math.isfinite(s["test_loss"]) and s["test_accuracy"] >= 0.9, (what, s)
    steps = {json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl") if '"event": "step"' in line}
    assert steps == set(range(1, DILOCO_STEPS + 1)), (what, "metrics lost steps", sorted(set(range(1, DILOCO_STEPS + 1)) - steps))
    assert "recovered: lost rank(s)" in log, what
