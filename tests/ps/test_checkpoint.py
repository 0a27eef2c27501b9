"""Checkpoints of the 'ps' strategy: every rank meets at a step boundary (the interval, or a
pause some rank asks for), the file holds the servers' shards as the global params/ and
optim/ tensors plus the worker clocks; resuming (other server counts, from or into dp)
continues the uninterrupted run; SIGTERM to one rank of a ps job checkpoints every rank."""
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from mpidist.checkpoint import REQUEUE_EXIT_CODE, CheckpointManager, open_checkpoint
from mpidist.engine.config import validate
from mpidist.engine.loop import run
from mpidist.launcher import mpiexec_argv
from mpidist.ps.strategy import ParameterServerStrategy
from mpidist.state import gather_state
from tests.checkpoint.test_jobs import ROOT, _wait_for, clean_env

META = {"kind": "classification", "in_shape": (64,), "classes": 10}


def _raw(tmp, name, parallel, steps, interval=0, resume=False):
    return {"job": {"name": name, "steps": steps, "progress": False, "plot": False,
                    "out_dir": os.path.join(tmp, name)},
            "model": {"name": "mlp", "hidden": [32]},
            "data": {"dataset": "digits", "batch_size": 60, "cache_dir": tmp},
            "optim": {"name": "sgd", "lr": 0.2, "hyper": {"momentum": 0.9}},
            "parallel": parallel,
            "checkpoint": {"interval": interval, "resume": resume,
                           "dir": os.path.join(tmp, name, "checkpoints")}}


def _train(comm, tmp, name, parallel, steps, **kw):
    return run(validate(_raw(tmp, name, parallel, steps, **kw), name=name, world_size=comm.size), comm)


def _resume(comm, tmp, name, parallel, steps, start):
    """Train `name` from a copy of run `start`'s step-3 checkpoint."""
    if comm.rank == 0:
        os.makedirs(os.path.join(tmp, name, "checkpoints"))
        shutil.copy(os.path.join(tmp, start, "checkpoints", "ckpt-00000003.h5"),
                    os.path.join(tmp, name, "checkpoints"))
    comm.comm.Barrier()
    return _train(comm, tmp, name, parallel, steps, resume=True)


def _final(comm, tmp, name, step=6) -> dict:
    with open_checkpoint(os.path.join(tmp, name, "checkpoints", f"ckpt-{step:08d}.h5"), comm=comm) as src:
        return {k: src.read_full(k) for k in src.keys() if k.startswith(("params/", "optim/"))}


def _close(a: dict, b: dict, atol):
    assert sorted(a) == sorted(b)
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a) < atol


@pytest.mark.mpi(min_size=2)
def test_bsp_resume_equals_uninterrupted_and_moves_to_and_from_dp(comm, shared_dir):
    bsp = {"strategy": "ps", "consistency": "bsp"}
    _train(comm, shared_dir, "straight", bsp, 6)
    _train(comm, shared_dir, "half", bsp, 3, interval=3)
    with open_checkpoint(os.path.join(shared_dir, "half", "checkpoints", "ckpt-00000003.h5"),
                         comm=comm) as src:
        assert src.shape("ps/clock") == (comm.size - 1,)
        assert src.read("ps/clock").tolist() == [3] * (comm.size - 1)
    _resume(comm, shared_dir, "resumed", bsp, 6, "half")
    ref = _final(comm, shared_dir, "straight")
    assert _close(_final(comm, shared_dir, "resumed"), ref, 1e-6)
    # the same logical tensors: a ps checkpoint continues under dp, a dp one under ps
    _resume(comm, shared_dir, "to-dp", {"strategy": "dp"}, 6, "half")
    _train(comm, shared_dir, "dp-half", {"strategy": "dp"}, 3, interval=3)
    _resume(comm, shared_dir, "from-dp", bsp, 6, "dp-half")
    assert _close(_final(comm, shared_dir, "to-dp"), ref, 1e-5)
    assert _close(_final(comm, shared_dir, "from-dp"), ref, 1e-5)


@pytest.mark.mpi(min_size=3)
def test_resume_with_another_server_count_reshards(comm, shared_dir):
    _train(comm, shared_dir, "straight", {"strategy": "ps", "servers": 1}, 6)
    _train(comm, shared_dir, "half", {"strategy": "ps", "servers": 2}, 3, interval=3)
    _resume(comm, shared_dir, "resumed", {"strategy": "ps", "servers": 1}, 6, "half")
    assert _close(_final(comm, shared_dir, "resumed"), _final(comm, shared_dir, "straight"), 1e-6)


def _strategy(comm, tmp, consistency, steps, interval=0):
    raw = _raw(tmp, "manual", {"strategy": "ps", "consistency": consistency}, steps, interval)
    cfg = validate(raw, name="manual", world_size=comm.size)
    cfg["job"]["total_steps"] = steps
    return ParameterServerStrategy(cfg, comm, META, timeout=60.0)


def _drive(s, rng, until=None, on_boundary=None):
    """The training loop's part: every rank calls train_step; collectives at boundaries only."""
    while s.step < s.total_steps:
        lo, n = s.shard_rows(60)
        x = rng.standard_normal((n, 64)).astype(np.float32) if n else None
        y = rng.integers(0, 10, n) if n else None
        s.train_step(x, y, global_count=60)
        if s.at_boundary():
            if on_boundary is not None:
                on_boundary(s)
            if until is not None and until(s):
                return


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("consistency", ["asp", "bsp"])
@pytest.mark.parametrize("asker", ["worker", "server"])
def test_pause_holds_the_servers_parameters_and_resume_continues_from_them(comm, shared_dir,
                                                                          consistency, asker):
    rng = np.random.default_rng(comm.rank)
    s = _strategy(comm, shared_dir, consistency, steps=10**6)   # ASP workers may run far ahead
    try:
        # one rank is signalled from the start (rank 0 is a worker, the last rank a server)
        me = 0 if asker == "worker" else comm.size - 1
        s.pause_on(lambda: comm.rank == me)
        _drive(s, rng, until=lambda st: True)
        stop = s.step
        comm.check_same(stop, "pause step")
        assert 0 < stop < s.total_steps
        held = s.ps.parameters()
        saved = gather_state(s.state_dict(), comm)
        flat = np.concatenate([saved.tensors[f"params/{seg.name}"].reshape(-1) for seg in s.layout])
        np.testing.assert_array_equal(flat, held)              # exactly the servers' parameters
        assert saved.tensors["ps/clock"].sum() // s.data_size == stop
    finally:
        s.close()
    again = _strategy(comm, shared_dir, consistency, steps=stop + 6, interval=2)
    try:
        again.load_state_dict(saved)
        assert again.step == stop
        np.testing.assert_array_equal(again.ps.parameters(), held)
        # what the next step pulls (every worker pulls before any pushes: ASP would move on)
        pulled = again.worker.pull() if again.worker is not None else held
        assert comm.all(np.array_equal(pulled, held, equal_nan=True))
        boundaries = []
        _drive(again, rng, on_boundary=lambda st: boundaries.append(st.step))
        comm.check_same(boundaries, "checkpoint steps")
        if consistency == "bsp":                           # every 2 steps, and the end
            assert boundaries == sorted({t for t in range(stop + 1, stop + 6) if t % 2 == 0} | {stop + 6})
        else:                                              # the step may jump over several
            assert boundaries == sorted(set(boundaries)) and boundaries[-1] == stop + 6
    finally:
        again.close()


def _rank_pid(tag: str, rank: int) -> int | None:
    """The pid of `rank` of the job whose environment holds MPIDIST_TEST_TAG=tag."""
    want = {f"MPIDIST_TEST_TAG={tag}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if want <= set(fh.read().split(b"\0")):
                    return int(pid)
        except OSError:
            continue
    return None


@pytest.mark.launcher
@pytest.mark.timeout(240)
def test_sigterm_to_the_server_checkpoints_every_rank_and_the_job_resumes(tmp_path):
    """jobs/digits_ps_bsp.toml on 4 ranks (rank 3 is the server): SIGTERM to the server alone
    -> every rank stops after the same step, writes one checkpoint, exits 75; --resume goes on."""
    job = os.path.join(ROOT, "jobs", "digits_ps_bsp.toml")
    out = tmp_path / "run"

    def argv(steps, *extra):
        return mpiexec_argv(4, [sys.executable, "-m", "mpidist", "train", job, "--out", str(out),
                                "--set", f"job.steps={steps}", "--set", "job.progress=false",
                                "--set", "job.plot=false", "--set", "job.target_accuracy=0",
                                "--set", f"data.cache_dir='{tmp_path}'",
                                "--set", "parallel.straggler=0.005", *extra])

    env = {**clean_env(4), "MPIDIST_TEST_TAG": str(tmp_path)}
    proc = subprocess.Popen(argv(100000, "--set", "checkpoint.interval=100000"), env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = out / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5, 120,
                  "a few training steps")
        os.kill(_rank_pid(str(tmp_path), 3), signal.SIGTERM)
        text, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == REQUEUE_EXIT_CODE, text[-3000:]
    steps = CheckpointManager(str(out / "checkpoints")).steps()
    assert len(steps) == 1 and 5 <= steps[0] < 100000, (steps, text[-2000:])
    stop = steps[0]
    resumed = subprocess.run(argv(stop + 4, "--resume"), env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    done = [r["step"] for r in rows if r.get("event") == "step"]
    assert done[-4:] == list(range(stop + 1, stop + 5)), done[-8:]
