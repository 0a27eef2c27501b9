"""ZeRO stages 1-3 train exactly like data parallelism, and hold what the formulas say.

The data-parallel reference here is the textbook one: every rank holds the whole model,
computes the gradient of its rows, the gradients are summed with mpidist's allreduce, and
the optimizer updates everything. ZeRO must give the same parameters (within 1e-6 relative;
in practice bit-identical) on the same global batch, at any world size.
"""
import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from mpidist.collectives import allreduce
from mpidist.comm import Communicator
from mpidist.flat import FlatBuffer, Layout
from mpidist.nn import CNN, GPT, MLP, Linear, Module, Sequential, SoftmaxCrossEntropy
from mpidist.optim import build_optimizer
from mpidist.partition import chunk
from mpidist.state import gather_state
from mpidist.zero import build_zero, model_state_bytes

BF16 = np.dtype(ml_dtypes.bfloat16)
HYPER = {"sgd": {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3},
         "adamw": {"lr": 0.01, "weight_decay": 0.01},
         "lars": {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3},
         "lamb": {"lr": 0.01, "weight_decay": 0.01}}
BATCH, STEPS = 12, 4


def make_opt(name):
    def make(layout, offset, count, dtype):
        return build_optimizer(name, layout, offset=offset, count=count, param_dtype=dtype,
                               **HYPER[name])
    return make


def mlp():
    # 97 parameters: no world size of 2..4 divides it, and fc1.weight straddles shards
    return MLP(7, 3, hidden=(5, 6))


def batches(seed=1, steps=STEPS, batch=BATCH):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(steps, batch, 7)), rng.integers(0, 3, size=(steps, batch))


def data_parallel(model, opt_name, dtype, comm, xs, ys):
    """The reference: whole model everywhere, allreduce of gradients, full-range optimizer."""
    layout = Layout(model.param_shapes())
    params, grads = FlatBuffer(layout, dtype=dtype), FlatBuffer(layout, dtype=dtype)
    model.bind(params.views(), grads.views())
    model.init_params(np.random.default_rng(0))
    opt = make_opt(opt_name)(layout, 0, layout.numel, dtype)
    loss = SoftmaxCrossEntropy()
    lo, n = chunk(xs.shape[1], comm.rank, comm.size)
    losses = []
    for x, y in zip(xs, ys):
        grads.data[...] = 0
        l, _ = loss.forward(model.forward(x[lo:lo + n]), y[lo:lo + n])
        model.backward(loss.backward(1.0 / y.size))
        allreduce(grads.data, op="sum", comm=comm)
        opt.step(params.data, grads.data, finite=True)
        losses.append(comm.comm.allreduce(l) / y.size)
    return params.data.astype(np.float64), np.array(losses)


def train_zero(stage, model, opt_name, dtype, comm, xs, ys, **kw):
    eng = build_zero(stage, model, make_opt(opt_name), comm=comm, dtype=dtype, seed=0, **kw)
    lo, n = chunk(xs.shape[1], comm.rank, comm.size)
    losses = [eng.train_step(x[lo:lo + n], y[lo:lo + n], global_count=y.size)["loss"]
              for x, y in zip(xs, ys)]
    return eng, eng.full_params().astype(np.float64), np.array(losses)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw", "lars", "lamb"])
def test_every_stage_equals_data_parallel(comm, opt_name, dtype):
    xs, ys = batches()
    ref, ref_losses = data_parallel(mlp(), opt_name, dtype, comm, xs, ys)
    for stage in (1, 2, 3):
        # buckets of 64 bytes: several buckets and layers in flight during backward
        eng, got, losses = train_zero(stage, mlp(), opt_name, dtype, comm, xs, ys,
                                      bucket_mb=64 / 2**20)
        assert rel(got, ref) <= 1e-6, (stage, rel(got, ref))
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
        assert eng.count == chunk(97, comm.rank, comm.size)[1]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_evaluate_before_training_uses_the_initial_model(comm, stage):
    xs, ys = batches(steps=1)
    lo, n = chunk(BATCH, comm.rank, comm.size)
    model = mlp()
    model.bind(*(FlatBuffer(Layout(model.param_shapes())).views() for _ in range(2)))
    model.init_params(np.random.default_rng(0))
    want, _ = SoftmaxCrossEntropy().forward(model.forward(xs[0], train=False), ys[0])
    eng = build_zero(stage, mlp(), make_opt("adamw"), comm=comm, seed=0)
    got = eng.evaluate(xs[0][lo:lo + n], ys[0][lo:lo + n])
    assert got["count"] == BATCH and got["loss"] == pytest.approx(want, rel=1e-6)
    assert eng.memory_report().in_flight == 0


def test_fp16_parameters_with_fp32_masters(comm):
    xs, ys = batches()
    ref, _ = data_parallel(mlp(), "adamw", np.float16, comm, xs, ys)
    for stage in (1, 3):
        _, got, _ = train_zero(stage, mlp(), "adamw", np.float16, comm, xs, ys)
        assert rel(got, ref) <= 1e-6


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_non_finite_gradient_on_one_rank_skips_the_step_everywhere(comm, stage):
    xs, ys = batches(steps=2)
    lo, n = chunk(BATCH, comm.rank, comm.size)
    eng = build_zero(stage, mlp(), make_opt("adamw"), comm=comm, seed=0)
    eng.train_step(xs[0][lo:lo + n], ys[0][lo:lo + n], global_count=BATCH)
    before = eng.full_params()
    x = xs[1][lo:lo + n].copy()
    if comm.rank == comm.size - 1:
        x[0, 0] = np.inf                          # one rank's gradient becomes non-finite
    with np.errstate(all="ignore"):
        m = eng.train_step(x, ys[1][lo:lo + n], global_count=BATCH)
    assert m["skipped"] and eng.optimizer.step_count == 1
    assert np.array_equal(eng.full_params(), before)


def _gpt_case():
    rng = np.random.default_rng(3)
    return (lambda: GPT(vocab=11, block=4, dim=8, heads=2, layers=2),
            rng.integers(0, 11, size=(2, 6, 4)), rng.integers(0, 11, size=(2, 6, 4)))


def _cnn_case():
    rng = np.random.default_rng(4)
    return (lambda: CNN((1, 4, 4), 3, channels=(2, 3)),
            rng.normal(size=(2, 6, 16)), rng.integers(0, 3, size=(2, 6)))


@pytest.mark.parametrize("case", [_gpt_case, _cnn_case], ids=["gpt", "cnn"])
def test_stage2_and_3_with_nested_and_convolutional_layers(comm, case):
    """GPT: embeddings, attention with Linear children, layer norms, backward order not the
    layout's reversed; CNN: convolutions inside a nested Sequential."""
    make, xs, ys = case()
    ref, ref_losses = data_parallel(make(), "adamw", np.float32, comm, xs, ys)
    for stage in (2, 3):
        _, got, losses = train_zero(stage, make(), "adamw", np.float32, comm, xs, ys,
                                    bucket_mb=0)
        assert rel(got, ref) <= 1e-6
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)


def test_more_ranks_than_parameters(comm):
    """3 parameters: at 4 ranks one shard is empty, and every stage still trains like dp."""
    def tiny():
        return Sequential(Linear(1, 3, bias=False))
    rng = np.random.default_rng(5)
    xs, ys = rng.normal(size=(3, 8, 1)), rng.integers(0, 3, size=(3, 8))
    ref, _ = data_parallel(tiny(), "lamb", np.float32, comm, xs, ys)
    for stage in (1, 2, 3):
        eng, got, _ = train_zero(stage, tiny(), "lamb", np.float32, comm, xs, ys)
        assert eng.count == chunk(3, comm.rank, comm.size)[1]
        assert rel(got, ref) <= 1e-6


def test_stage3_on_a_one_rank_communicator(comm):
    """World size 1 with stage 3 simply works (every rank runs its own one-rank job)."""
    solo = Communicator(MPI.COMM_SELF)
    try:
        xs, ys = batches(seed=comm.rank)
        ref, _ = data_parallel(mlp(), "lamb", np.float32, solo, xs, ys)
        eng, got, _ = train_zero(3, mlp(), "lamb", np.float32, solo, xs, ys)
        assert rel(got, ref) == 0.0
        assert eng.count == 97
    finally:
        solo.free()


@pytest.mark.parametrize("stage", [0, 4, -1, "3", 2.0, True, None])
def test_stage_outside_1_to_3_is_refused_before_work(comm, stage):
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        build_zero(stage, mlp(), make_opt("sgd"), comm=comm)


def test_bad_dtype_is_refused_on_every_rank(comm):
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        build_zero(1, mlp(), make_opt("sgd"), comm=comm, dtype=np.int32)


@pytest.mark.parametrize("dtype,opt_name,optim_bytes", [
    (BF16, "adamw", 12), (np.float16, "adamw", 12), (np.float32, "adamw", 8),
    (BF16, "sgd", 8), (np.float32, "lamb", 8)])
def test_memory_report_equals_the_formulas(comm, dtype, opt_name, optim_bytes):
    xs, ys = batches(steps=1)
    item = np.dtype(dtype).itemsize
    for stage in (1, 2, 3):
        eng, _, _ = train_zero(stage, mlp(), opt_name, dtype, comm, xs, ys)
        rep = eng.memory_report()
        shard = chunk(97, comm.rank, comm.size)[1]
        want = model_state_bytes(stage, 97, shard, param_bytes=item, grad_bytes=item,
                                 optim_bytes=optim_bytes)
        assert (rep.params, rep.grads, rep.optim) == want, (stage, rep)
        assert rep.model_states == sum(want) and rep.shard == shard and rep.numel == 97
        assert rep.in_flight == 0                   # everything transient was released
        assert rep.workspace == (0 if item == 4 else 4 * shard)   # fp32 grad scratch


def test_stage2_never_holds_the_whole_gradient(comm):
    """One layer per bucket, one bucket in flight: a rank holds its gradient shard plus at most
    the bucket being filled and the one being reduced (its buffer and the owner's receive
    buffer of `size - 1` pieces); stage 3 adds the layer in use and the one prefetched."""
    xs, ys = batches(steps=2)
    for stage in (2, 3):
        eng, _, _ = train_zero(stage, MLP(7, 3, hidden=(16,) * 16), "adamw", np.float32, comm,
                               xs, ys, bucket_mb=1e-9, max_in_flight=1)
        rep = eng.memory_report()
        largest = max(u.numel for u in eng.units)
        bound = (2 * largest * comm.size + (2 * largest if stage == 3 else 0)) * 4
        assert rep.peak_in_flight <= bound < eng.layout.numel * 4, rep
        assert rep.grads == chunk(eng.layout.numel, comm.rank, comm.size)[1] * 4


def test_stage3_prefetches_the_next_layer(comm):
    eng = build_zero(3, MLP(7, 3, hidden=(5, 6, 5)), make_opt("sgd"), comm=comm, seed=0)
    xs, ys = batches(steps=2)
    lo, n = chunk(BATCH, comm.rank, comm.size)
    seen = []
    fetch = eng.gather._fetch

    def spy(unit):
        seen.append((unit.index, unit.index in eng.gather.cache))
        return fetch(unit)
    eng.gather._fetch = spy
    for x, y in zip(xs, ys):
        seen.clear()
        eng.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)
    # step 2 knows the forward order: every gather starts once, one layer ahead of its use,
    # so every layer but the first of each phase is already in flight when it is needed
    assert [i for i, cached in seen if not cached] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [i for i, cached in seen if cached] == [1, 2, 3, 2, 1, 0]


class Twice(Module):
    """Applies the same Linear twice: a layer shared within one step."""

    def __init__(self):
        super().__init__()
        self.fc = self.add_child("fc", Linear(3, 3))

    def forward(self, x, train=True):
        return self.fc.forward(self.fc.forward(x, train), train)

    def backward(self, dy):
        return self.fc.backward(self.fc.backward(dy))


@pytest.mark.parametrize("stage", [2, 3])
def test_shared_layer_is_reported_at_stage_2_and_3(comm, stage):
    eng = build_zero(stage, Twice(), make_opt("sgd"), comm=comm)
    x, y = np.ones((2, 3)), np.zeros(2, dtype=np.int64)
    with pytest.raises(RuntimeError, match="ran backward twice"):
        eng.train_step(x, y, global_count=2 * comm.size)
    assert eng.memory_report().in_flight > 0            # the failed step left buffers behind
    eng._begin_step()                                   # the next step releases them first
    eng._begin_forward()
    assert eng.memory_report().in_flight == 0


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("save_stage,load_stage", [(3, 1), (1, 3), (2, 2)])
def test_state_dict_is_global_and_reshards(comm, save_stage, load_stage, dtype):
    """Save at N ranks; load into another stage at N ranks and into one rank alone."""
    xs, ys = batches(steps=4)
    lo, n = chunk(BATCH, comm.rank, comm.size)
    eng = build_zero(save_stage, mlp(), make_opt("lamb"), comm=comm, dtype=dtype, seed=0)
    for x, y in zip(xs[:2], ys[:2]):
        eng.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)
    sd = eng.state_dict()
    states = {"exp_avg", "exp_avg_sq"} | ({"master"} if dtype == BF16 else set())
    assert {k.split("/")[1] for k in sd.tensors if k.startswith("optim/")} == states
    full = gather_state(sd, comm)
    assert np.array_equal(full.tensors["params/fc1.weight"].reshape(-1).astype(np.float64),
                          eng.full_params()[:35].astype(np.float64))
    for x, y in zip(xs[2:], ys[2:]):
        eng.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)
    want = eng.full_params().astype(np.float64)

    # same world size, another stage: training continues identically
    other = build_zero(load_stage, mlp(), make_opt("lamb"), comm=comm, dtype=dtype, seed=9)
    other.load_state_dict(full)
    assert other.step == 2 and other.optimizer.step_count == 2
    for x, y in zip(xs[2:], ys[2:]):
        other.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)
    assert rel(other.full_params().astype(np.float64), want) <= 1e-6

    # one rank: it holds every global tensor whole, exactly as written
    solo = Communicator(MPI.COMM_SELF)
    try:
        alone = build_zero(load_stage, mlp(), make_opt("lamb"), comm=solo, dtype=dtype, seed=9)
        alone.load_state_dict(full)
        back = gather_state(alone.state_dict(), solo)
        assert set(back.tensors) == set(full.tensors)
        for key, value in full.tensors.items():
            assert np.array_equal(back.tensors[key], value), key
        if dtype == np.float32:      # and trains on the whole batch like the N ranks did
            for x, y in zip(xs[2:], ys[2:]):
                alone.train_step(x, y, global_count=BATCH)
            assert rel(alone.full_params().astype(np.float64), want) <= 1e-6
    finally:
        solo.free()
