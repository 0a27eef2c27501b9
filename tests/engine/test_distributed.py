"""DistributedOptimizer and the data-parallel strategy on real MPI ranks (any world size)."""
import numpy as np
import pytest
from mpi4py import MPI

from mpidist import nn
from mpidist.comm import Communicator
from mpidist.data import ArrayDataset, DistributedSampler, iterate, synthetic_arrays
from mpidist.engine.config import validate
from mpidist.engine.distributed import DistributedOptimizer, make_buckets
from mpidist.engine.dp import DataParallel
from mpidist.flat import FlatBuffer, Layout
from mpidist.optim import build_optimizer
from mpidist.state import InMemoryState, gather_state


def _config(optim="sgd", hyper=None, lr=0.05, **parallel):
    cfg = validate({"job": {"seed": 3}, "model": {"name": "mlp", "hidden": [16, 12]},
                    "data": {"dataset": "synthetic", "batch_size": 12},
                    "optim": {"name": optim, "lr": lr, "hyper": hyper or {}},
                    "parallel": {"strategy": "dp", "algorithm": "ring", **parallel}})
    cfg["job"]["total_steps"] = 100
    return cfg


META = {"kind": "classification", "in_shape": (10,), "classes": 4}


def _train(comm, cfg, steps=6, epoch=0):
    """Losses of `steps` steps of DataParallel on a synthetic set, global batch 12."""
    x, y = synthetic_arrays(60, 10, 4, seed=1)
    data = ArrayDataset(x, y, META)
    strategy = DataParallel(cfg, comm, META)
    sampler = DistributedSampler(data.n, 12, rank=comm.rank, size=comm.size, seed=3)
    sampler.set_epoch(epoch)
    losses = []
    for (xb, yb, count), _ in zip(iterate(data, sampler), range(steps)):
        losses.append(strategy.train_step(xb, yb, global_count=count)["loss"])
    return np.array(losses), strategy


@pytest.mark.parametrize("optim,hyper,parallel", [
    ("sgd", {"momentum": 0.9}, {}),
    ("lamb", {}, {"bucket_mb": 0.0001}),
    ("adamw", {}, {"accumulation": 2, "bucket_mb": 0.0}),
])
def test_dp_over_p_ranks_equals_one_rank_with_the_same_global_batch(comm, optim, hyper, parallel):
    cfg = _config(optim, hyper, lr=0.01 if optim != "sgd" else 0.05, **parallel)
    losses, strategy = _train(comm, cfg)
    solo_comm = Communicator(MPI.COMM_SELF)
    solo_losses, solo = _train(solo_comm, cfg)
    assert np.allclose(losses, solo_losses, rtol=2e-5, atol=1e-6), (losses, solo_losses)
    assert np.allclose(strategy.params.data, solo.params.data, rtol=1e-4, atol=1e-6)
    assert losses[-1] < losses[0]
    solo_comm.free()


def test_same_seed_same_world_size_is_bit_identical(comm):
    a, sa = _train(comm, _config("lamb", lr=0.01, bucket_mb=0.0001))
    b, sb = _train(comm, _config("lamb", lr=0.01, bucket_mb=0.0001))
    assert np.array_equal(a, b) and np.array_equal(sa.params.data, sb.params.data)
    comm.check_same(sa.params.data.tobytes(), "parameters after training")


def test_buckets_launch_during_backward(comm):
    """With small buckets every bucket is in flight before step(); the last layer's first."""
    model = nn.MLP(10, 4, hidden=[16, 12])
    layout, params, grads = nn.materialize(model)
    dopt = DistributedOptimizer(build_optimizer("sgd", layout, lr=0.1), params, grads, comm=comm,
                                algorithm="ring", bucket_mb=0.0001)
    dopt.attach(model)
    assert len(dopt.buckets) > 2 and dopt.buckets[0][1] == layout.numel
    model.backward(model.forward(np.ones((3, 10), np.float32)) * 0 + 1)
    assert dopt.in_flight == (len(dopt.buckets) if comm.size > 1 else 0)   # one rank sends nothing
    info = dopt.step()
    assert info["applied"] and not info["skipped"] and dopt.in_flight == 0


def test_make_buckets_cover_the_buffer_in_reverse():
    layout = Layout([("a", (100,)), ("b", (3,)), ("c", (50,)), ("d", (7,))])
    for mb in (0.0, 1e-9, 200 * 4 / 2 ** 20, 60 * 4 / 2 ** 20):
        b = make_buckets(layout, 4, mb)
        assert b[0][1] == layout.numel and b[-1][0] == 0
        assert all(b[i][0] == b[i + 1][1] for i in range(len(b) - 1))
        assert all(lo in layout.bounds and hi in layout.bounds for lo, hi in b)
    assert make_buckets(layout, 4, 0.0) == [(0, 160)]
    assert make_buckets(layout, 4, 1e-9) == [(153, 160), (103, 153), (100, 103), (0, 100)]


def test_make_buckets_taper_at_both_ends_of_backward():
    """The first bucket (last layers) and those within bucket_mb of the buffer's start
    (what backward finishes last) close at a quarter of bucket_mb; the middle at bucket_mb."""
    layout = Layout([(f"t{i}", (256,)) for i in range(64)])      # 1 KiB tensors
    b = make_buckets(layout, 4, 16 / 1024)                         # 16 KiB buckets
    sizes = [(hi - lo) * 4 // 1024 for lo, hi in b]
    assert sizes[0] == 4 and sizes[1:3] == [16, 16] and sum(sizes) == 64
    tail = [s for s, (lo, hi) in zip(sizes, b) if hi * 4 <= 16 * 1024]
    assert sum(tail) >= 12 and max(tail) <= 4


def test_existing_code_loop_with_plain_arrays(comm):
    """Logistic regression with the user's own arrays and hand-computed gradients."""
    rng = np.random.default_rng(0)
    x, y = synthetic_arrays(48, 5, 3, seed=2)
    onehot = np.eye(3, dtype=np.float32)[y]
    w = rng.normal(0, 0.1, (5, 3)).astype(np.float32) * (comm.rank + 1)   # ranks start apart...
    b = np.zeros(3, np.float32)

    def grads_of(w, b, xs, ts):
        z = xs @ w + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        d = (p - ts) / len(xs)
        return [xs.T @ d, d.sum(0)]

    dopt = DistributedOptimizer.for_arrays([w, b], lambda layout: build_optimizer("sgd", layout, lr=0.5),
                                           comm=comm, algorithm="ring", op="avg")
    ref_w, ref_b = w.copy(), b.copy()         # ...and broadcast makes them rank 0's
    comm.check_same(w.tobytes(), "w after broadcast")
    lo, hi = comm.rank * 48 // comm.size, (comm.rank + 1) * 48 // comm.size
    for _ in range(5):
        shard = slice(lo, hi)
        g = grads_of(w, b, x[shard], onehot[shard])
        weight = (hi - lo) * comm.size / 48      # op="avg" wants each rank's local mean; rescale
        dopt.step([gi * weight for gi in g])     # for uneven shards so the average is the global mean
        gw, gb = grads_of(ref_w, ref_b, x, onehot)
        ref_w -= 0.5 * gw
        ref_b -= 0.5 * gb
    assert np.allclose(w, ref_w, atol=1e-5) and np.allclose(b, ref_b, atol=1e-5)


def test_accumulation_sends_only_on_the_last_micro_step(comm):
    layout = Layout([("p0", (4,))])
    w = np.ones(4, np.float32)
    dopt = DistributedOptimizer.for_arrays([w], lambda lay: build_optimizer("sgd", lay, lr=1.0), comm=comm,
                                           accumulation=3, op="avg")
    assert dopt.layout == layout
    for i in range(2):
        info = dopt.step([np.full(4, 1.0, np.float32)])
        assert not info["applied"] and np.all(w == 1)
    info = dopt.step([np.full(4, float(comm.rank), np.float32)])
    # average over ranks and micro-steps of (1, 1, rank)
    expected = 1 - (2 + (comm.size - 1) / 2) / 3
    assert info["applied"] and np.allclose(w, expected)


def test_non_finite_gradient_on_one_rank_skips_the_step_everywhere(comm):
    w = np.ones(6, np.float32)
    dopt = DistributedOptimizer.for_arrays([w], lambda lay: build_optimizer("sgd", lay, lr=1.0), comm=comm)
    g = np.ones(6, np.float32)
    if comm.rank == comm.size - 1:
        g[2] = np.nan
    info = dopt.step([g], stats=[comm.rank])
    assert info["skipped"] and np.all(w == 1)
    assert info["stats"][0] == comm.size * (comm.size - 1) / 2
    info = dopt.step([np.ones(6, np.float32)])
    assert not info["skipped"] and np.allclose(w, 0.0)


@pytest.mark.mpi(min_size=2)
def test_settings_mismatch_raises_on_every_rank(comm):
    from mpidist.errors import MismatchError
    w = np.ones(3, np.float32)
    with pytest.raises(MismatchError, match="DistributedOptimizer settings"):
        DistributedOptimizer.for_arrays([w], lambda lay: build_optimizer("sgd", lay, lr=1.0), comm=comm,
                                        bucket_mb=1.0 + (comm.rank == comm.size - 1))


def test_bad_arguments():
    w = np.ones(3, np.float32)
    with pytest.raises(TypeError, match="FlatBuffer"):
        DistributedOptimizer(None, w, w)


def test_state_dict_round_trip_at_any_world_size(comm):
    losses, strategy = _train(comm, _config("adamw", lr=0.01), steps=3)
    full = gather_state(strategy.state_dict(), comm)
    states = sorted(strategy.optimizer.state_buffers())
    assert states and set(full.keys()) == {f"{p}/{n}" for p in ["params"] + [f"optim/{s}" for s in states]
                                           for n in strategy.layout.names}
    assert np.array_equal(full.tensors["params/fc1.weight"], strategy.params.view("fc1.weight"))
    fresh = DataParallel(_config("adamw", lr=0.01), comm, META)
    fresh.load_state_dict(InMemoryState(full.step, full.tensors, full.scalars))
    assert fresh.step == 3 and np.array_equal(fresh.params.data, strategy.params.data)
    for k, v in strategy.optimizer.state_buffers().items():
        assert np.array_equal(fresh.optimizer.state_buffers()[k], v)
    mem = strategy.memory_report()
    assert mem["params"] == strategy.params.data.nbytes and mem["total"] >= mem["params"] + mem["grads"]


@pytest.mark.parametrize("compression", ["fp16", "topk"])
def test_compressed_data_parallel_trains_and_ranks_agree(comm, compression):
    losses, strategy = _train(comm, _config("sgd", {"momentum": 0.9}, lr=0.05, compression=compression,
                                            bucket_mb=0.0001), steps=8)
    assert strategy.dopt.compressed is not None and strategy.dopt.compressed.step > 0
    assert np.isfinite(losses).all() and losses[-3:].mean() < losses[:3].mean()
    comm.check_same(strategy.params.data.tobytes(), "parameters after compressed training")


def test_compression_options_and_warmup_reach_the_compressed_allreduce(comm):
    """Warm-up covering every step is the uncompressed run; after it, top-k (ratio from
    compression_options) changes the steps."""
    plain, _ = _train(comm, _config("sgd", {"momentum": 0.9}, bucket_mb=0.0001), steps=6)
    warm, strategy = _train(comm, _config("sgd", {"momentum": 0.9}, bucket_mb=0.0001, compression="topk",
                                          compression_options={"ratio": 0.2}, compression_warmup=6), steps=6)
    ca = strategy.dopt.compressed
    assert ca.warmup_steps == 6 and ca.compressor.config()["ratio"] == 0.2
    np.testing.assert_allclose(warm, plain, rtol=1e-5, atol=1e-6)
    part, strategy = _train(comm, _config("sgd", {"momentum": 0.9}, bucket_mb=0.0001, compression="topk",
                                          compression_options={"ratio": 0.2}, compression_warmup=2), steps=6)
    np.testing.assert_allclose(part[:3], plain[:3], rtol=1e-5, atol=1e-6)  # step 3 uses step 2's update
    assert np.abs(part[3:] - plain[3:]).max() > 1e-4
    comm.check_same(strategy.params.data.tobytes(), "parameters after compressed training")


@pytest.mark.gpu
def test_dp_on_gpu_matches_cpu(comm):
    cfg = _config("adamw", lr=0.01)
    cpu, _ = _train(comm, cfg, steps=4)
    cfg["job"]["device"] = "gpu"
    gpu, strategy = _train(comm, cfg, steps=4)
    assert strategy.xp.__name__ == "cupy" and np.allclose(cpu, gpu, rtol=1e-4, atol=1e-5)


def test_accumulation_gives_the_same_steps(comm):
    one, _ = _train(comm, _config("sgd", {"momentum": 0.9}))
    three, _ = _train(comm, _config("sgd", {"momentum": 0.9}, accumulation=3))
    assert np.allclose(one, three, rtol=1e-5, atol=1e-6)


def test_language_model_dp_equals_one_rank(comm):
    """The GPT path: per-token loss normalisation, embeddings' sparse gradients."""
    meta = {"kind": "lm", "vocab": 16, "block": 8}
    cfg = validate({"model": {"name": "gpt", "dim": 16, "heads": 2, "layers": 1},
                    "data": {"dataset": "text", "block": 8, "batch_size": 6},
                    "optim": {"name": "adamw", "lr": 0.01}, "parallel": {"algorithm": "ring"}})
    cfg["job"]["total_steps"] = 10
    tokens = np.random.default_rng(3).integers(0, 16, (30, 9))

    def train(c):
        s = DataParallel(cfg, c, meta)
        out = []
        for _ in range(4):
            rows = tokens[:6]                  # one batch, learnt step by step
            lo, n = s.shard_rows(6)
            out.append(s.train_step(rows[lo:lo + n, :-1], rows[lo:lo + n, 1:], global_count=6)["loss"])
        return np.array(out), s

    losses, s = train(comm)
    solo_comm = Communicator(MPI.COMM_SELF)
    solo, _ = train(solo_comm)
    solo_comm.free()
    assert np.allclose(losses, solo, rtol=1e-5) and losses[-1] < losses[0]
    assert 2.0 < losses[0] < 3.5            # about log(16) at the start: a per-token mean


def test_optimizer_state_is_broadcast_from_rank_0(comm):
    layout = Layout([("w", (5,))])
    opt = build_optimizer("adamw", layout, lr=0.1)
    for buf in opt.state_buffers().values():
        buf[...] = comm.rank + 1
    params = FlatBuffer(layout)
    params.data[...] = comm.rank
    DistributedOptimizer(opt, params, params.zeros_like(), comm=comm)
    assert np.all(params.data == 0) and all(np.all(b == 1) for b in opt.state_buffers().values())


def test_compression_is_one_object_a_compressor_or_a_compressed_allreduce(comm):
    """A compressor (or its name) is summed by a CompressedAllreduce with nonfinite="skip";
    a CompressedAllreduce given whole is used as it is (its warm-up here): the same steps."""
    from mpidist.compress import CompressedAllreduce, make_compressor

    def run(compression):
        w = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)
        dopt = DistributedOptimizer.for_arrays([w], lambda lay: build_optimizer("sgd", lay, lr=0.1),
                                               comm=comm, compression=compression, bucket_mb=0)
        for step in range(3):
            dopt.step([w * (comm.rank + 1) + step])
        return w, dopt.compressed

    by_name, ca = run("fp16")
    assert ca.nonfinite == "skip" and ca.warmup_steps == 0
    by_compressor, _ = run(make_compressor("fp16"))
    warm, ca = run(CompressedAllreduce(make_compressor("fp16"), comm, warmup_steps=3, nonfinite="skip"))
    plain, none = run(None)
    assert none is None and ca.warmup_steps == 3
    assert by_name.tobytes() == by_compressor.tobytes()
    np.testing.assert_allclose(warm, plain, rtol=1e-6, atol=1e-6)   # warm-up: the float32 sum
    comm.check_same(by_name.tobytes(), "parameters after fp16 steps")
