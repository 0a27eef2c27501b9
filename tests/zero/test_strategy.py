"""strategy = "zero" through the engine's registry: same steps as strategy = "dp" on the same
config, state in the engine's global-tensor contract, memory in the metrics; and the main
job's model trained with stage 3 by `mpidist train` (launcher test)."""
import json
import os
import sys

import numpy as np
import pytest

from mpidist import launcher
from mpidist.engine.config import validate
from mpidist.engine.strategies import build_strategy
from mpidist.errors import ConfigError
from mpidist.state import gather_state

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
META = {"kind": "classification", "in_shape": [7], "classes": 3}
BATCH = 10


def config(strategy, batch=BATCH, **parallel):
    """A validated 4-step LAMB job on synthetic data, for `strategy` with [parallel] keys."""
    raw = {"job": {"seed": 3, "steps": 4}, "model": {"name": "mlp", "hidden": [5, 6]},
           "data": {"dataset": "synthetic", "features": 7, "classes": 3, "batch_size": batch},
           "optim": {"name": "lamb", "lr": 0.01, "hyper": {"weight_decay": 0.01},
                     "schedule": "cosine", "warmup_steps": 2},
           "parallel": {"strategy": strategy, "algorithm": "ring", **parallel}}
    cfg = validate(raw)
    cfg["job"]["total_steps"], cfg["job"]["steps_per_epoch"] = 4, 4
    return cfg


def run(strategy, comm):
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(4):
        x = rng.normal(size=(BATCH, 7)).astype(np.float32)
        y = rng.integers(0, 3, BATCH)
        lo, n = strategy.shard_rows(BATCH)
        m = strategy.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)
        losses.append(m["loss"])
    lo, n = strategy.shard_rows(BATCH)
    ev = strategy.evaluate(x[lo:lo + n], y[lo:lo + n])
    return np.array(losses), m, ev, gather_state(strategy.state_dict(), comm)


@pytest.mark.parametrize("stage,accumulation", [(1, 1), (2, 1), (3, 1), (1, 2), (2, 3), (3, 2)])
def test_zero_strategy_follows_the_data_parallel_strategy(comm, stage, accumulation):
    ref_losses, _, ref_eval, ref_state = run(
        build_strategy(config("dp", accumulation=accumulation), comm, META), comm)
    zero = build_strategy(config("zero", stage=stage, bucket_mb=1e-4, accumulation=accumulation),
                          comm, META)
    losses, m, ev, state = run(zero, comm)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert ev["count"] == ref_eval["count"] == BATCH and ev["correct"] == ref_eval["correct"]
    assert zero.step == 4 and m["lr"] > 0
    assert set(state.tensors) == set(ref_state.tensors)          # same global tensors
    for key, want in ref_state.tensors.items():
        got = state.tensors[key]
        assert got.shape == want.shape
        assert np.linalg.norm(got - want) <= 1e-6 * max(1e-30, np.linalg.norm(want)), key
    rep = zero.memory_report()
    assert m["mem_optim"] == rep["optim"] and rep["total"] >= rep["params"] + rep["optim"]
    shard = zero.engine.count
    assert rep["optim"] == 2 * 4 * shard                         # LAMB: two fp32 moments


@pytest.mark.parametrize("compression,options,warmup", [
    ("topk", {"ratio": 0.3}, 0), ("qsgd", {"levels": 3}, 1), ("powersgd", {"rank": 1}, 0)])
def test_zero_1_with_compression_follows_data_parallel_with_the_same_compression(
        comm, compression, options, warmup):
    """The same compressed sum as dp's one-bucket exchange (bucket_mb = 0), then the sharded
    step: the same run to 1e-6."""
    kw = dict(compression=compression, compression_options=options, compression_warmup=warmup)
    dp = build_strategy(config("dp", bucket_mb=0, **kw), comm, META)
    ref_losses, _, _, ref_state = run(dp, comm)
    zero = build_strategy(config("zero", stage=1, **kw), comm, META)
    losses, m, _, state = run(zero, comm)
    ca = zero.engine.compression
    assert ca.step == 4 and ca.warmup_steps == warmup and ca.total_bytes_sent == dp.dopt.compressed.total_bytes_sent
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for key, want in ref_state.tensors.items():
        assert np.linalg.norm(state.tensors[key] - want) <= 1e-6 * max(1e-30, np.linalg.norm(want)), key
    plain = build_strategy(config("zero", stage=1), comm, META)
    assert not np.allclose(run(plain, comm)[3].tensors["params/fc1.weight"], state.tensors["params/fc1.weight"],
                           rtol=1e-4, atol=0)     # compression did change the steps


def test_mixed_precision_from_the_config(comm):
    """dtype = "bfloat16": 2-byte params and grads, fp32 masters; stages agree to the bit."""
    results = []
    for stage in (1, 3):
        zero = build_strategy(config("zero", stage=stage, dtype="bfloat16"), comm, META)
        losses, m, _, state = run(zero, comm)
        results.append((losses, state))
        shard = zero.engine.count
        assert m["mem_params"] == 2 * (shard if stage == 3 else zero.engine.layout.numel)
        assert m["mem_optim"] == 12 * shard                      # master + two moments
        assert state.tensors["params/fc1.weight"].dtype == np.dtype("bfloat16")
    np.testing.assert_array_equal(results[0][0], results[1][0])
    for key, want in results[0][1].tensors.items():
        assert np.array_equal(results[1][1].tensors[key], want), key


def test_zero_strategy_checks_its_keys(comm):
    with pytest.raises(ConfigError, match="compression"):
        build_strategy(config("zero", stage=2, compression="powersgd"), comm, META)
    with pytest.raises(ConfigError, match="stage"):
        validate({"parallel": {"strategy": "zero", "stage": 4}})


def _train(job, out, tmp_path):
    # a session started by mpiexec -n 1 passes its Open MPI/PMIx variables on, and a child
    # mpiexec seeing them refuses to start ("recursive calls"): start it from a clean env
    env = launcher.without_job_variables(os.environ)
    proc = launcher.run(4, [sys.executable, "-m", "mpidist", "train", str(job),
                            "--set", f"job.out_dir='{out}'", "--set", "job.progress=false",
                            "--set", "job.plot=false", "--set", f"data.cache_dir='{tmp_path}'",
                            "--set", f"checkpoint.dir='{out / 'ckpt'}'"],
                        timeout=280, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return proc, json.loads((out / "summary.json").read_text()), rows


@pytest.mark.launcher
@pytest.mark.timeout(600)
def test_main_job_model_trains_with_stage_3_like_data_parallel(tmp_path):
    """jobs/digits_zero3.toml on 4 ranks: >= 95% test accuracy, and the same run as its
    data-parallel twin (the same file with strategy = "dp") to float tolerance."""
    job = os.path.abspath(os.path.join(ROOT, "jobs", "digits_zero3.toml"))
    text = open(job).read()
    assert 'strategy = "zero"\nstage = 3\n' in text
    twin = tmp_path / "digits_dp.toml"
    twin.write_text(text.replace('strategy = "zero"\nstage = 3\n',
                                 'strategy = "dp"\nalgorithm = "ring"\n'))
    proc, summary, rows = _train(job, tmp_path / "zero3", tmp_path)
    _, dp_summary, dp_rows = _train(twin, tmp_path / "dp", tmp_path)
    assert summary["strategy"] == "zero" and summary["test_accuracy"] >= 0.95
    assert summary["test_accuracy"] == dp_summary["test_accuracy"]
    assert summary["test_loss"] == pytest.approx(dp_summary["test_loss"], rel=1e-5)
    losses = [r["loss"] for r in rows if r["event"] == "step"]
    assert losses == pytest.approx([r["loss"] for r in dp_rows if r["event"] == "step"], rel=1e-5)

    assert proc.stderr.count("memory at start: rank") == 4, proc.stderr[-3000:]
    numel = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    # rank 0's shard of fp32 params + grads + LAMB's two moments: 16 bytes / 4 per parameter
    mem = summary["memory"]
    assert mem["params"] + mem["grads"] + mem["optim"] == 16 * -(-numel // 4)
    steps = [r for r in rows if r["event"] == "step"]
    assert len(steps) == summary["steps"]
    assert all(r["mem_model_states"] == 16 * -(-numel // 4) for r in steps)   # in the metrics
