"""Checkpoint jobs at several world sizes, signals and rank death: each test starts its own
mpiexec jobs through mpidist.launcher (marked `launcher`: run once, in the one-rank session)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mpidist.checkpoint import REQUEUE_EXIT_CODE, CheckpointManager, inspect_checkpoint
from mpidist.launcher import mpi_env, mpiexec_argv, run, without_job_variables

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TOY = os.path.join(HERE, "toyjob.py")


def clean_env(n):
    """Environment for a job of n ranks, without the variables of the MPI job we may be in
    (under `mpiexec -n 1 pytest` a nested mpiexec would take them for its own)."""
    base = without_job_variables(os.environ)
    return mpi_env(n, base)


def launch(n, argv, timeout=120, **kw):
    return run(n, [sys.executable] + argv, timeout=timeout,
               env=without_job_variables(os.environ), capture_output=True, text=True, cwd=ROOT,
               **kw)


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.launcher
def test_save_at_p_load_at_q(tmp_path):
    """Files written at p = 1..4 ranks are read back, resharded, at q = 1..4 ranks."""
    job = os.path.join(HERE, "reshard_job.py")
    for p in (1, 2, 3, 4):
        ok(launch(p, [job, str(tmp_path)]))
    for q in (1, 2, 3):
        ok(launch(q, [job, str(tmp_path), "--no-write"]))
    lines = (tmp_path / "log.txt").read_text().split("\n")
    for p in (1, 2, 3, 4):
        for q in (1, 2, 3, 4):
            assert f"read w{p}.h5 at {q}" in lines, (p, q)


@pytest.mark.launcher
def test_training_resumed_on_other_world_sizes_equals_uninterrupted(tmp_path):
    """3 ranks to step 4, then 4 ranks to step 8, then 1 rank to 12 == 2 ranks straight to 12."""
    ref, chain = tmp_path / "ref", tmp_path / "chain"
    ok(launch(2, [TOY, "--dir", str(ref), "--steps", "12", "--out", str(ref / "out.json")]))
    ok(launch(3, [TOY, "--dir", str(chain), "--steps", "12", "--stop-at", "4"]))
    ok(launch(4, [TOY, "--dir", str(chain), "--steps", "12", "--stop-at", "8"]))
    ok(launch(1, [TOY, "--dir", str(chain), "--steps", "12", "--out", str(chain / "out.json")]))
    a = json.loads((ref / "out.json").read_text())
    b = json.loads((chain / "out.json").read_text())
    assert b["resumed_from"]["step"] == 8 and b["resumed_from"]["world_size"] == 4
    assert len(b["losses"]) == len(a["losses"]) == 12
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-6, atol=0)
    np.testing.assert_allclose(b["w"], a["w"], rtol=0, atol=1e-6)
    assert a["losses"][-1] < 0.1 * a["losses"][0]          # it did learn


def _wait_for(predicate, timeout, what):
    t0 = time.time()
    while not predicate():
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


@pytest.mark.launcher
def test_sigterm_mid_run_checkpoints_and_exits_cleanly_on_every_rank(tmp_path, comm):
    """SIGTERM to ONE rank: all ranks agree at the end of the step, write one complete
    checkpoint together and exit with the requeue code."""
    proc = subprocess.Popen(mpiexec_argv(3, [sys.executable, TOY, "--dir", str(tmp_path), "--steps",
                                             "10000", "--every", "100000", "--sleep", "0.05"]),
                            env=clean_env(3), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)
    try:
        _wait_for(lambda: all((tmp_path / f"pid.{r}").exists() for r in range(3)), 60, "ranks to start")
        time.sleep(1.0)
        os.kill(int((tmp_path / "pid.1").read_text()), signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == REQUEUE_EXIT_CODE, out[-3000:]
    notes = "".join((tmp_path / f"preempted.{r}").read_text() for r in range(3)
                    if (tmp_path / f"preempted.{r}").exists())
    said = re.findall(r"rank (\d+): preempted by signal \S+, checkpoint at step (\d+)", notes)
    assert sorted(r for r, _ in said) == ["0", "1", "2"], notes + out[-3000:]
    steps = {step for _, step in said}
    assert len(steps) == 1                        # every rank stopped after the same step
    mgr = CheckpointManager(str(tmp_path), comm=comm)
    assert mgr.steps() == [int(steps.pop())]
    with mgr.open_latest() as src:                # complete and verified
        assert src.world_size == 3 and len(src.scalars["losses"]) == src.step


@pytest.mark.launcher
def test_sigkill_of_one_rank_ends_the_job_and_a_restart_resumes(tmp_path):
    t0 = time.time()
    proc = launch(3, [TOY, "--dir", str(tmp_path), "--steps", "10", "--every", "4",
                      "--die-rank", "1", "--die-step", "6"], timeout=90)
    elapsed = time.time() - t0
    assert proc.returncode != 0 and elapsed < 60, (proc.returncode, elapsed)
    assert inspect_checkpoint(str(tmp_path / "ckpt-00000004.h5"))["step"] == 4
    ok(launch(2, [TOY, "--dir", str(tmp_path), "--steps", "10", "--every", "4",
                  "--out", str(tmp_path / "out.json")]))
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["resumed_from"]["step"] == 4 and len(out["losses"]) == 10


@pytest.mark.launcher
def test_main_job_resumes_across_strategies_and_world_sizes(tmp_path):
    """The engine: data parallel on 4 ranks checkpoints; ZeRO-3 on 3 ranks and a 2-stage
    pipeline on 2 ranks resume from its step-6 checkpoint and follow the same loss curve."""
    common = ["-m", "mpidist", "train", os.path.join(ROOT, "jobs", "digits_lamb.toml"),
              "--set", "job.steps=12", "--set", "job.progress=false", "--set", "job.plot=false",
              "--set", "job.target_accuracy=0", "--set", "checkpoint.interval=6",
              "--set", "checkpoint.keep=2"]
    ok(launch(4, common + ["--out", str(tmp_path / "dp")], timeout=300))
    runs = {"zero": (3, ["--set", "parallel.strategy=zero", "--set", "parallel.stage=3"]),
            "pipeline": (2, ["--set", "parallel.strategy=pipeline", "--set", "parallel.stages=2"])}
    for name, (n, extra) in runs.items():
        os.makedirs(tmp_path / name / "checkpoints")
        shutil.copy(tmp_path / "dp" / "checkpoints" / "ckpt-00000006.h5", tmp_path / name / "checkpoints")
        ok(launch(n, common + extra + ["--out", str(tmp_path / name), "--resume"], timeout=300))
    ref = _losses(tmp_path / "dp" / "metrics.jsonl")
    for name in runs:
        got = _losses(tmp_path / name / "metrics.jsonl")
        assert sorted(got) == list(range(7, 13)), name
        assert max(abs(got[s] - ref[s]) for s in got) < 1e-6, name


def _losses(path) -> dict:
    rows = [json.loads(line) for line in open(path)]
    return {r["step"]: r["loss"] for r in rows if r.get("event") == "step"}
