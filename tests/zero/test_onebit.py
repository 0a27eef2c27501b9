"""1-bit Adam / 1-bit LAMB in the engines: dp, ZeRO stages 1-3 and a one-stage pipeline
(with or without its ZeRO-1) give the same run (one range per step, or buckets with an
element-wise compressor); pipeline stages exchange momentum over their dp groups; after the
warm-up no gradient is sent and far fewer bytes go out; a run resumed from its state (in
the warm-up or after it) continues as the uninterrupted one; settings that cannot work are
refused."""
import numpy as np
import pytest

from mpidist.engine.config import validate
from mpidist.engine.strategies import build_strategy
from mpidist.errors import ConfigError
from mpidist.state import gather_state

META = {"kind": "classification", "in_shape": [7], "classes": 3}
BATCH, STEPS, FREEZE = 12, 8, 3


def config(strategy, optim="onebit_lamb", compressor="sign", options=None, **parallel):
    raw = {"job": {"seed": 3, "steps": STEPS}, "model": {"name": "mlp", "hidden": [40, 33]},
           "data": {"dataset": "synthetic", "features": 7, "classes": 3, "batch_size": BATCH},
           "optim": {"name": optim, "lr": 0.01, "schedule": "cosine", "warmup_steps": 2,
                     "hyper": {"weight_decay": 0.01, "freeze_step": FREEZE,
                               "compressor": compressor,
                               "compressor_options": {"chunk": 32} if options is None else options}},
           "parallel": {"strategy": strategy, "algorithm": "ring", **parallel}}
    cfg = validate(raw)
    cfg["job"]["total_steps"], cfg["job"]["steps_per_epoch"] = STEPS, STEPS
    return cfg


def run(strategy, comm, steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        x = rng.normal(size=(BATCH, 7)).astype(np.float32)
        y = rng.integers(0, 3, BATCH)
        lo, n = strategy.shard_rows(BATCH)
        m = strategy.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)
        assert not m.get("skipped")
        losses.append(m["loss"])
    return np.array(losses), gather_state(strategy.state_dict(), comm)


def close(state, ref, rtol=1e-5):
    """Model tensors within rtol (norm-wise); 1-bit LAMB's fresh variance within 10 rtol:
    it comes from the gradient the momentum implies, (m - b1*m_old)/(1-b1), a difference
    of near-equal numbers that magnifies their last-bit differences."""
    for key, want in ref.tensors.items():
        if key.startswith(("params/", "optim/")):
            got = state.tensors[key]
            tol = 10 * rtol if "/exp_avg_sq_fresh/" in key else rtol
            assert np.linalg.norm(got - want) <= tol * max(1e-30, np.linalg.norm(want)), key


@pytest.mark.parametrize("optim", ["onebit_adam", "onebit_lamb"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("compressor,options,bucket_mb,rtol", [
    ("sign", {"chunk": 32}, 0, 1e-4), ("bf16", {"error_feedback": True}, 1e-4, 1e-5)],
    ids=["sign-one-range", "bf16-buckets"])
def test_zero_stages_follow_data_parallel(comm, optim, stage, compressor, options, bucket_mb,
                                          rtol):
    """The warm-up's sums differ in their last bits between dp's ring allreduce and ZeRO's
    reduce-scatter; signs turn such a difference into an occasional flipped sign (hence
    1e-4 there), an element-wise compressor does not."""
    dp = build_strategy(config("dp", optim, compressor, options), comm, META)
    want_losses, want = run(dp, comm)
    zero = build_strategy(config("zero", optim, compressor, options, stage=stage,
                                 bucket_mb=bucket_mb), comm, META)
    losses, got = run(zero, comm)
    np.testing.assert_allclose(losses, want_losses, rtol=rtol)
    close(got, want, rtol)
    assert zero.engine.onebit.frozen and dp.dopt.onebit.frozen
    # the server residuals are one global tensor, written by each chunk's owner (what a
    # compressor drops flips with the last bits of its input: compared in size only here;
    # test_onebit checks them element by element against the reference)
    key = "compress/server_residual/fc1.weight"
    res, ref = got.tensors[key], want.tensors[key]
    assert res.shape == ref.shape
    if comm.size > 1:   # one rank: the server re-encodes a decoded payload exactly, drops 0
        assert np.linalg.norm(res) > 0
        assert abs(np.linalg.norm(res) / np.linalg.norm(ref) - 1) < 0.1


@pytest.mark.parametrize("zero", [0, 1])
def test_one_stage_pipeline_follows_data_parallel(comm, zero):
    dp = build_strategy(config("dp"), comm, META)
    want_losses, want = run(dp, comm)
    pipe = build_strategy(config("pipeline", stages=1, microbatches=1, zero=zero), comm, META)
    losses, got = run(pipe, comm)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4)
    close(got, want, 1e-4)
    assert pipe.onebit.frozen


@pytest.mark.mpi(min_size=2)
def test_pipeline_stages_exchange_momentum_in_their_dp_groups(comm):
    stages = 2 if comm.size % 2 == 0 else 1
    kw = dict(stages=stages, microbatches=2)
    pipe = build_strategy(config("pipeline", **kw), comm, META)
    run(pipe, comm, steps=FREEZE + 1)
    ex = pipe.onebit.ex
    assert ex.comm.size == comm.size // stages and ex.n == pipe.layout.numel
    assert (ex.bytes_sent > 0) == (ex.comm.size > 1)
    saved = gather_state(pipe.state_dict(), comm)
    resumed = build_strategy(config("pipeline", **kw), comm, META)
    resumed.load_state_dict(saved)
    want, _ = run(pipe, comm, steps=2, seed=1)
    got, _ = run(resumed, comm, steps=2, seed=1)
    np.testing.assert_array_equal(got, want)


def test_after_the_warm_up_only_the_compressed_momentum_goes_out(comm):
    dp = build_strategy(config("dp", compressor="sign", options={}), comm, META)
    run(dp, comm, steps=FREEZE + 2)
    ex = dp.dopt.onebit.ex
    assert dp.dopt.in_flight == 0 and ex.total_bytes_sent > 0 or comm.size == 1
    if comm.size > 1:
        n = dp.layout.numel
        dense = 2 * (comm.size - 1) / comm.size * 4 * n
        assert ex.bytes_sent < dense / 10


@pytest.mark.parametrize("strategy,extra", [("dp", {}), ("zero", {"stage": 2, "bucket_mb": 1e-4})])
@pytest.mark.parametrize("stop", [FREEZE - 1, FREEZE + 2])
def test_resume_continues_the_uninterrupted_run(comm, strategy, extra, stop):
    """Stop in the warm-up or after it, load the state into a fresh strategy: the rest of
    the run equals the uninterrupted one (residuals, phase and the LAMB ratios travel)."""
    straight = build_strategy(config(strategy, **extra), comm, META)
    run(straight, comm, steps=stop)
    saved = gather_state(straight.state_dict(), comm)
    if stop > FREEZE:
        assert "compress/residual/fc1.weight" in saved.tensors
        assert "compress/server_residual/fc1.weight" in saved.tensors
    resumed = build_strategy(config(strategy, **extra), comm, META)
    resumed.load_state_dict(saved)
    want, _ = run(straight, comm, steps=STEPS - stop, seed=1)
    got, _ = run(resumed, comm, steps=STEPS - stop, seed=1)
    np.testing.assert_array_equal(got, want)


@pytest.mark.mpi(min_size=2)
def test_resume_at_another_world_size(comm):
    """Written by p ranks, read by p - 1: the phase goes on (no new warm-up), each new worker
    residual is the sum of the old ones over the new count, and the server residuals are
    the same global tensor, cut into the new chunks."""
    from mpi4py import MPI

    from mpidist.comm import Communicator
    straight = build_strategy(config("dp"), comm, META)
    run(straight, comm, steps=FREEZE + 2)
    saved = gather_state(straight.state_dict(), comm)
    split = comm.comm.Split(0 if comm.rank < comm.size - 1 else MPI.UNDEFINED, comm.rank)
    if split == MPI.COMM_NULL:
        return
    sub = Communicator(split)
    try:
        resumed = build_strategy(config("dp"), sub, META)
        resumed.load_state_dict(saved)
        assert resumed.optimizer.frozen and resumed.optimizer.step_count == FREEZE + 2
        ex, n = resumed.dopt.onebit.ex, resumed.layout.numel
        rows = np.concatenate([saved.tensors[f"compress/residual/{s.name}"].reshape(comm.size, -1)
                               for s in resumed.layout], axis=1)
        np.testing.assert_allclose(ex.worker.compressor.residual, rows.sum(0) / sub.size,
                                   rtol=1e-5, atol=1e-9)
        server = np.concatenate([saved.tensors[f"compress/server_residual/{s.name}"].reshape(-1)
                                 for s in resumed.layout])
        np.testing.assert_array_equal(ex.server.residual, server[ex.offset:ex.offset + ex.count])
        assert ex.count < n or sub.size == 1
        losses, _ = run(resumed, sub, steps=2)
        assert np.isfinite(losses).all()
    finally:
        sub.free()


def test_distributed_optimizer_avg_and_sum_conventions_agree(comm):
    """for_arrays with op="avg" (each rank passes its mean gradient) and op="sum" (its share
    of the sum) feed the same local momenta to the exchange: the same parameters."""
    from mpidist.engine.distributed import DistributedOptimizer
    from mpidist.optim import build_optimizer

    def make(layout):
        return build_optimizer("onebit_adam", layout, lr=0.01, freeze_step=2)

    out = []
    for op in ("avg", "sum"):
        rng = np.random.default_rng(0)
        arrays = [np.ones((6, 5), np.float32), np.zeros(5, np.float32)]
        dopt = DistributedOptimizer.for_arrays(arrays, make, comm=comm, op=op)
        for _ in range(6):
            grads = [rng.standard_normal((comm.size,) + a.shape).astype(np.float32)[comm.rank]
                     for a in arrays]
            dopt.step([g if op == "avg" else g / np.float32(comm.size) for g in grads])
        assert dopt.onebit.frozen
        out.append(np.concatenate([a.ravel() for a in arrays]))
    np.testing.assert_allclose(out[0], out[1], rtol=1e-4, atol=1e-6)


def test_refusals(comm):
    with pytest.raises(ConfigError, match="remove \\[parallel\\] compression"):
        config("dp", compression="topk")
    with pytest.raises(ConfigError, match="accumulation = 1"):
        config("zero", stage=2, accumulation=2)
    with pytest.raises(ConfigError, match="cannot compress the momentum"):
        config("dp", compressor="powersgd", options={})
