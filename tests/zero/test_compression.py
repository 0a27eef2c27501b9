"""ZeRO stages 2 and 3 with gradient compression (each bucket by the compressed
reduce-scatter): the same run as dp with the same compression, where the compressor acts
element by element; stages 2 and 3 agree with any compressor; checkpoints carry the
residuals and the velocity; PowerSGD is refused."""
import numpy as np
import pytest

from mpidist.engine.strategies import build_strategy
from mpidist.errors import ConfigError
from mpidist.state import gather_state
from tests.zero.test_strategy import BATCH, META, config


def run(strategy, comm, steps=4, seed=0):
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        x = rng.normal(size=(BATCH, 7)).astype(np.float32)
        y = rng.integers(0, 3, BATCH)
        lo, n = strategy.shard_rows(BATCH)
        losses.append(strategy.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)["loss"])
    return np.array(losses), gather_state(strategy.state_dict(), comm)


def close(state, ref, skip=("compress/",)):
    for key, want in ref.tensors.items():
        if not key.startswith(skip):
            got = state.tensors[key]
            assert np.linalg.norm(got - want) <= 1e-6 * max(1e-30, np.linalg.norm(want)), key


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("compression,options,warmup", [
    ("bf16", {"error_feedback": True}, 0), ("fp16", {"scaling": False, "error_feedback": True}, 1)])
def test_stages_2_and_3_follow_data_parallel_with_the_same_compression(comm, stage, compression,
                                                                       options, warmup):
    """An element-wise compressor encodes a piece as it encodes the whole buffer, and both
    sum the decoded payloads in rank order: the same run to 1e-6, buckets or not."""
    kw = dict(compression=compression, compression_options=options, compression_warmup=warmup)
    ref_losses, ref = run(build_strategy(config("dp", compression_allreduce="gather", **kw),
                                         comm, META), comm)
    zero = build_strategy(config("zero", stage=stage, bucket_mb=1e-4, **kw), comm, META)
    losses, state = run(zero, comm)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    close(state, ref)
    ca = zero.engine.compression
    assert len(ca.state_dict()["buffers"]) == len(zero.engine.grads.buckets) > 1
    assert ca.step == 4 * len(zero.engine.grads.buckets)


def test_stage_2_and_3_agree_with_top_k_and_it_changes_the_steps(comm):
    kw = dict(compression="topk", bucket_mb=1e-4,
              compression_options={"ratio": 0.1, "momentum": 0.9, "warmup": [[0.5, 1]]})
    two_losses, two = run(build_strategy(config("zero", stage=2, **kw), comm, META), comm)
    three_losses, three = run(build_strategy(config("zero", stage=3, **kw), comm, META), comm)
    np.testing.assert_allclose(three_losses, two_losses, rtol=1e-6)
    close(three, two, skip=())
    assert "compress/residual/fc1.weight" in two.tensors
    _, plain = run(build_strategy(config("zero", stage=2, bucket_mb=1e-4), comm, META), comm)
    assert not np.allclose(plain.tensors["params/fc1.weight"], two.tensors["params/fc1.weight"],
                           rtol=1e-4, atol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_resumed_from_a_state_dict_follows_the_uninterrupted_run(comm, stage):
    """Residuals and velocity of every bucket go out with state_dict and come back."""
    kw = dict(compression="topk", bucket_mb=1e-4,
              compression_options={"ratio": 0.2, "momentum": 0.5})
    straight = build_strategy(config("zero", stage=stage, **kw), comm, META)
    run(straight, comm, steps=2)
    saved = gather_state(straight.state_dict(), comm)
    assert any(k.endswith("/velocity") for k in saved.tensors)
    resumed = build_strategy(config("zero", stage=stage, **kw), comm, META)
    resumed.load_state_dict(saved)
    want, _ = run(straight, comm, steps=2, seed=1)
    got, _ = run(resumed, comm, steps=2, seed=1)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_powersgd_is_refused_at_stages_2_and_3(comm):
    with pytest.raises(ConfigError, match="'powersgd' works with zero stage = 1 only"):
        build_strategy(config("zero", stage=2, compression="powersgd"), comm, META)


@pytest.mark.parametrize("strategy,extra", [("dp", {}), ("zero", {"stage": 1}),
                                            ("pipeline", {"stages": 1, "microbatches": 1})])
def test_compression_allreduce_reaches_every_strategy(comm, strategy, extra):
    """[parallel] compression_allreduce picks the compressed allreduce's algorithm; auto is
    the format's own."""
    for how, want in (("ring", "ring"), ("auto", "gather")):
        s = build_strategy(config(strategy, batch=12, compression="sign",   # 12: splits over 1-4
                                  compression_allreduce=how, **extra), comm, META)
        ca = {"dp": lambda: s.dopt.compressed, "zero": lambda: s.engine.compression,
              "pipeline": lambda: s.compressed}[strategy]()
        assert ca.algorithm == want
