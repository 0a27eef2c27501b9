"""Asynchronous DiLoCo over the parameter server: delayed Nesterov against torch's Nesterov
step, one group equals synchronous DiLoCo, the digits job converges, and with a straggler
the fast groups push more rounds than the slow one instead of waiting for it."""
import os
import tomllib

import numpy as np
import pytest

from mpidist.diloco.delayed import DelayedNesterov
from mpidist.engine.config import validate
from mpidist.engine.loop import run
from mpidist.engine.strategies import build_strategy
from mpidist.errors import ConfigError
from mpidist.flat import Layout
from mpidist.optim import build_optimizer
from mpidist.partition import chunk
from mpidist.strategy.metrics import read_metrics

from .diloco_case import ADAMW, BATCH, META, batches, config, loop_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_delayed_nesterov_over_n_pushes_is_one_nesterov_step():
    """N pushes (one by one, or drained together) move theta as torch's Nesterov SGD does
    with their mean, round after round; between momentum steps only lr / N of each."""
    n, N, lr, beta = 7, 3, 0.7, 0.9
    layout = Layout([("w", (n,))])
    ref = build_optimizer("sgd", layout, lr=lr, momentum=beta, nesterov=True)
    one, together = DelayedNesterov(0, n, lr=lr, momentum=beta, delay=N), \
        DelayedNesterov(0, n, lr=lr, momentum=beta, delay=N)
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(n).astype(np.float32)
    a, b, r = theta.copy(), theta.copy(), theta.copy()
    for _ in range(4):
        pushes = rng.standard_normal((N, n)).astype(np.float32)
        before = a.copy()
        one.step(a, pushes[0])
        np.testing.assert_allclose(a, before - lr / N * pushes[0], rtol=1e-6)
        for g in pushes[1:]:
            one.step(a, g)
        together.step(b, pushes[0])
        together.step(b, pushes[1:].sum(axis=0), pushes=N - 1)
        ref.step(r, pushes.mean(axis=0))
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b, r, rtol=1e-5, atol=1e-6)
    assert one.step_count == together.step_count == 4
    with pytest.raises(ValueError, match="delay must be an int >= 1"):
        DelayedNesterov(0, n, lr=lr, momentum=beta, delay=0)


@pytest.mark.mpi(min_size=2)
def test_one_group_is_synchronous_diloco(comm):
    """A server and every other rank in one group, delay 1: each round's pull is the
    synchronous outer step of diloco run by the same ranks on the same rows."""
    steps, sync, workers = 6, 2, comm.size - 1
    data = batches(steps)
    common = {"group_size": workers, "sync_every": sync, "outer_lr": 0.7, "outer_momentum": 0.9}
    a = build_strategy(config("diloco_async", ADAMW, steps, **common), comm, META)
    side = comm.split(color=int(a.topo.is_server))
    worst = 0.0
    if a.topo.is_server:
        a.train_step(None, None, global_count=BATCH)
        assert a.step == steps and a.finished
    else:
        s = build_strategy(config("diloco", ADAMW, steps, **common), side, META)
        lo, n = chunk(BATCH, a.data_rank, a.data_size)
        for step, (x, y) in enumerate(data, start=1):
            ma = a.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)
            ms = s.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)
            assert ma["loss"] == pytest.approx(ms["loss"], rel=1e-5)
            if step % sync == 0:
                worst = max(worst, float(np.max(np.abs(a.params - s.inner.params.data))))
        assert a.step == steps and a.finished
        s.close()
    assert comm.all(worst < 1e-5), worst
    assert a.report()["rounds"] == [steps // sync]
    a.close()


def _digits_config(shared_dir, **parallel) -> dict:
    with open(os.path.join(ROOT, "jobs", "digits_diloco_async.toml"), "rb") as fh:
        raw = tomllib.load(fh)
    raw["job"].update(progress=False, plot=False, out_dir=os.path.join(shared_dir, "out"))
    raw["data"]["cache_dir"] = shared_dir
    raw["parallel"].update(parallel)
    return validate(raw, name="digits_diloco_async")


@pytest.mark.mpi(min_size=2)
def test_async_diloco_converges_on_the_digits_job(comm, shared_dir):
    """jobs/digits_diloco_async.toml (the main job's data and model, groups pushing without
    a barrier) past 93% test accuracy at any rank count, groups of 1 (of 2 at 5 ranks, as
    the job), the same final figures on every rank."""
    summary = run(_digits_config(shared_dir, group_size=2 if comm.size >= 5 else 1), comm)
    comm.check_same((summary["test_loss"], summary["test_accuracy"], summary["steps"]), "final evaluation")
    assert summary["test_accuracy"] > 0.93, summary


@pytest.mark.mpi(min_size=3)
def test_fast_groups_do_not_wait_for_a_straggler(comm):
    """The last group sleeps 20 ms per inner step: the others claim more of the rounds
    (a synchronous exchange would hold every group to the straggler's count). Counted
    over the fast groups together: on a busy host one of them may be starved by the OS."""
    steps, sync = 40, 2
    cfg = config("diloco_async", ADAMW, steps, group_size=1, sync_every=sync, straggler=0.02)
    s = build_strategy(cfg, comm, META)
    x, y = batches(1)[0]
    lo, n = chunk(BATCH, s.data_rank, s.data_size) if s.data_rank is not None else (0, 0)
    while s.step < steps:
        s.train_step(x[lo:lo + n] if n else None, y[lo:lo + n] if n else None, global_count=BATCH)
    rounds = s.report()["rounds"]
    s.close()
    groups = comm.size - 1
    assert len(rounds) == groups and sum(rounds) == -(-groups * steps // sync)
    assert sum(rounds[:-1]) >= 2 * (groups - 1) * rounds[-1], rounds


def test_config_names_the_async_options():
    with pytest.raises(ConfigError, match="servers = 2 leaves no worker"):
        validate({"parallel": {"strategy": "diloco_async", "servers": 2}}, world_size=2)
    with pytest.raises(ConfigError, match="outer_delay applies to strategy = 'diloco_async'"):
        validate({"parallel": {"strategy": "diloco", "outer_delay": 2}})
    with pytest.raises(ConfigError, match="outer_compression applies to strategy = 'diloco' or 'local_sgd'"):
        validate({"parallel": {"strategy": "diloco_async", "outer_compression": "fp16"}})
    assert validate({"parallel": {"strategy": "diloco_async", "straggler": 0.1}})["parallel"]["servers"] == 1


@pytest.mark.mpi(min_size=2)
def test_checkpoints_pass_between_async_and_synchronous_diloco(comm, shared_dir):
    """diloco_async saves theta_outer and the servers' momentum at its end; diloco resumes
    from it, and diloco_async again from diloco's checkpoint: each run goes on from the
    step it found, every rank agreeing on the result."""
    asynchronous = {"strategy": "diloco_async", "interval": 0, "group_size": 1}
    first = run(loop_config(shared_dir, "a", False, steps=8, **asynchronous), comm)
    second = run(loop_config(shared_dir, "b", True, steps=12, interval=0), comm)
    third = run(loop_config(shared_dir, "c", True, steps=16, **asynchronous), comm)
    assert (first["steps"], second["steps"], third["steps"]) == (8, 12, 16)
    comm.check_same(third["test_loss"], "final test loss")
    if comm.rank == 0:
        b = read_metrics(os.path.join(shared_dir, "b", "metrics.jsonl"))
        assert [r["step"] for r in b if r["event"] == "step"] == list(range(9, 13))
        assert sorted(os.listdir(os.path.join(shared_dir, "ckpt")))[-1] == "ckpt-00000016.h5"
