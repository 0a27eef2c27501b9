"""The executor on real ranks: pipeline training equals single-rank training (float64)."""
import numpy as np
import pytest
from mpi4py import MPI

from mpidist.nn import GPT, MLP, Dropout, Linear, Sequential, SoftmaxCrossEntropy, materialize
from mpidist.pipeline.executor import PipelineExecutor
from mpidist.pipeline.cuts import by_params
from mpidist.pipeline.schedules import build_schedule
from mpidist.pipeline.transport import single_copy
from mpidist.pipeline.stage import local_stages, materialize_stages, pipeline_layers
from mpidist.pipeline.timing import summarize

LR, STEPS, M = 0.1, 3, 4


def _mlp():
    return MLP(6, 5, hidden=(8, 8, 8, 8))          # 9 pipeline layers: 2 chunks x 4 ranks fit


def _data(size, model="mlp"):
    rng = np.random.default_rng(7)
    b = 2 * M
    if model == "mlp":
        return rng.standard_normal((b, 6)), rng.integers(0, 5, b)
    return rng.integers(0, 11, (b, 5)), rng.integers(0, 11, (b, 5))


def _single_rank(make, x, y, steps=STEPS, batches=None):
    """Reference: the whole model, the whole batch, plain SGD in float64."""
    model = make()
    layout, params, grads = materialize(model, dtype=np.float64, seed=3)
    loss = SoftmaxCrossEntropy()
    for x, y in batches or [(x, y)] * steps:
        grads.data[...] = 0
        loss.forward(model.forward(x), y)
        model.backward(loss.backward(1.0 / y.size))
        params.data -= LR * grads.data
    return layout.views(params.data)


def _pipeline(comm, make, x, y, name, virtual=1, recompute=False, steps=STEPS, keep_grads=False,
              progress_thread=None, batches=None):
    model = make()
    layers = pipeline_layers(model)
    bounds = by_params([l for _, l in layers], comm.size * virtual)
    stages = local_stages(layers, bounds, comm.size, comm.rank)
    layout, params, grads = materialize_stages(model, stages, dtype=np.float64, seed=3)
    ex = PipelineExecutor(build_schedule(name, comm.size, M, virtual), stages, comm,
                          recompute=recompute, progress_thread=progress_thread)
    stats = None
    for x, y in batches or [(x, y)] * steps:
        grads.data[...] = 0
        stats = ex.run(x, y)
        params.data -= LR * grads.data
    return layout.views(grads.data if keep_grads else params.data), stats, ex


def _max_rel(mine, ref):
    return max((np.abs(v - ref[n]).max() / np.abs(ref[n]).max() for n, v in mine.items()),
               default=0.0)      # a rank may hold only parameter-free layers


@pytest.mark.parametrize("recompute", [False, True], ids=["stash", "recompute"])
@pytest.mark.parametrize("name,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_pipeline_training_equals_single_rank(comm, name, virtual, recompute):
    """On one rank the stages hand over locally (interleaved: 2 chunks on the one rank)."""
    x, y = _data(comm.size)
    ref = _single_rank(_mlp, x, y)
    mine, stats, _ = _pipeline(comm, _mlp, x, y, name, virtual, recompute)
    losses = comm.comm.allgather(stats.loss_sum)
    assert _max_rel(mine, ref) < 1e-6
    # the loss is the pipeline-wide sum, the same on every rank
    assert np.isfinite(stats.loss_sum) and losses == [stats.loss_sum] * comm.size


@pytest.mark.mpi(min_size=2)
def test_progress_thread_changes_timing_only(comm):
    x, y = _data(comm.size)
    with_thread, _, ex = _pipeline(comm, _mlp, x, y, "1f1b", keep_grads=True,
                                   progress_thread=True)
    without, _, ex_off = _pipeline(comm, _mlp, x, y, "1f1b", keep_grads=True,
                                   progress_thread=False)
    assert ex.progress_thread and not ex_off.progress_thread      # mpi4py: THREAD_MULTIPLE
    for name, g in with_thread.items():
        np.testing.assert_array_equal(without[name], g)


def test_the_helper_thread_is_on_unless_transfers_move_by_single_copy(comm, monkeypatch):
    monkeypatch.setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    assert not single_copy(comm)
    monkeypatch.setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "cma")
    assert single_copy(comm) == ("Open MPI" in MPI.Get_library_version()
                                 and comm.num_nodes == 1)


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_identity_stages_pass_received_buffers_on(comm, name):
    """Middle stages that return their input: the buffer they send is the one they received
    (and their input gradient is the received gradient), so recycling must wait for it."""
    def make():
        mid = [Dropout(0.0) for _ in range(comm.size - 2)]
        return Sequential(Linear(6, 1024), *mid, Linear(1024, 5))   # 16 KiB: not eager
    x, y = _data(comm.size)
    ref = _single_rank(make, x, y)
    model = make()
    layers = pipeline_layers(model)
    stages = local_stages(layers, list(range(comm.size + 1)), comm.size, comm.rank)
    layout, params, grads = materialize_stages(model, stages, dtype=np.float64, seed=3)
    ex = PipelineExecutor(build_schedule(name, comm.size, M), stages, comm)
    for _ in range(STEPS):
        grads.data[...] = 0
        ex.run(x, y)
        params.data -= LR * grads.data
    assert _max_rel(layout.views(params.data), ref) < 1e-6


@pytest.mark.mpi(min_size=2)
def test_transformer_pipeline_equals_single_rank(comm):
    make = lambda: GPT(vocab=11, block=5, dim=8, heads=2, layers=comm.size)   # noqa: E731
    x, y = _data(comm.size, "gpt")
    ref = _single_rank(make, x, y, steps=2)
    mine, _, _ = _pipeline(comm, make, x, y, "1f1b", recompute=True, steps=2)
    assert _max_rel(mine, ref) < 1e-6


def test_recompute_replays_the_dropout_masks(comm):
    make = lambda: MLP(6, 5, hidden=(8,) * 4, dropout=0.5, seed=4)   # noqa: E731
    x, y = _data(comm.size)
    stash, _, _ = _pipeline(comm, make, x, y, "gpipe", steps=2, keep_grads=True)
    again, _, _ = _pipeline(comm, make, x, y, "gpipe", recompute=True, steps=2, keep_grads=True)
    for name, g in stash.items():
        np.testing.assert_array_equal(again[name], g)
    assert any(np.any(g != 0) for g in stash.values()) or not stash


@pytest.mark.mpi(min_size=2)
def test_in_flight_activations_and_memory(comm):
    x, y = _data(comm.size)
    p = comm.size
    _, g, _ = _pipeline(comm, _mlp, x, y, "gpipe", steps=1)
    _, f, _ = _pipeline(comm, _mlp, x, y, "1f1b", steps=1)
    _, fr, _ = _pipeline(comm, _mlp, x, y, "1f1b", recompute=True, steps=1)
    s = summarize(f, comm)
    assert g.peak_in_flight == M                                   # GPipe stashes all m
    assert f.peak_in_flight == min(p - comm.rank, M) <= p          # 1F1B at most p - r
    assert f.peak_stash_bytes <= min(p, M) * f.microbatch_stash_bytes
    assert g.peak_stash_bytes == M * g.microbatch_stash_bytes
    assert fr.peak_stash_bytes < f.peak_stash_bytes                # recompute keeps inputs only
    assert s["peak_in_flight"] == [min(p - r, M) for r in range(p)]
    assert 0.0 <= s["bubble"] < 1.0 and all(b > 0 for b in s["busy"])


@pytest.mark.mpi(min_size=2)
def test_buffers_are_reused_across_steps(comm):
    x, y = _data(comm.size)
    _, _, ex = _pipeline(comm, _mlp, x, y, "1f1b", steps=1)
    allocated = len(ex._pool.owned)
    for _ in range(3):
        ex.run(x, y)
    assert len(ex._pool.owned) == allocated
    # the shapes crossed each boundary once and are cached
    assert set(ex._meta_in) == {s for s in ex.stages if s > 0}


@pytest.mark.mpi(min_size=2)
def test_a_new_micro_batch_shape_exchanges_shapes_again(comm):
    x, y = _data(comm.size)
    batches = [(x, y), (np.concatenate([x, 2 * x]), np.concatenate([y, y[::-1]])), (x, y)]
    ref = _single_rank(_mlp, None, None, batches=batches)
    mine, _, _ = _pipeline(comm, _mlp, None, None, "1f1b", batches=batches)
    assert _max_rel(mine, ref) < 1e-6


@pytest.mark.mpi(min_size=2)
def test_batch_not_divisible_by_microbatches_fails_on_every_rank(comm):
    x, y = _data(comm.size)
    _, _, ex = _pipeline(comm, _mlp, x, y, "1f1b", steps=0)
    with pytest.raises(ValueError, match="equal micro-batches"):
        ex.run(x[:M + 1], y[:M + 1])


def test_executor_checks_its_arguments(comm):
    model = _mlp()
    layers = pipeline_layers(model)
    stages = local_stages(layers, by_params([l for _, l in layers], comm.size), comm.size,
                          comm.rank)
    with pytest.raises(ValueError, match="communicator of"):
        PipelineExecutor(build_schedule("1f1b", comm.size + 1, 2), stages, comm)
    with pytest.raises(ValueError, match="must hold stages"):
        PipelineExecutor(build_schedule("1f1b", comm.size, 2), {}, comm)
    with pytest.raises(TypeError):
        PipelineExecutor("1f1b", stages, comm)
