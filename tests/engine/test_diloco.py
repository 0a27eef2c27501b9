"""DiLoCo and local SGD in the engine, at any rank count (groups of 2 ranks; the last may
hold one): H = 1 with outer SGD lr 1 is data parallel, local SGD is the average of the
groups' independent runs at every sync, and a checkpoint written mid-round resumes the
same trajectory."""
import os

import numpy as np
import pytest
from mpi4py import MPI

from mpidist.checkpoint.manager import CheckpointManager
from mpidist.comm import Communicator
from mpidist.diloco import group_colors, make_groups
from mpidist.engine.config import validate
from mpidist.engine.loop import run
from mpidist.engine.strategies import build_strategy
from mpidist.errors import ConfigError
from mpidist.partition import chunk
from mpidist.state import read_flat
from mpidist.strategy.metrics import read_metrics

from .diloco_case import BATCH, META, batches, config, loop_config


def _agree(comm, ok: bool) -> bool:
    return comm.all(ok)


def test_groups_are_nodes_or_runs_of_group_size():
    assert group_colors([0, 0, 1, 1, 1], 0) == [0, 0, 1, 1, 1]
    assert group_colors([3, 3, 0, 0], 0) == [0, 0, 1, 1]          # numbered by lowest rank
    assert group_colors([0] * 5, 2) == [0, 0, 1, 1, 2]
    assert group_colors([0] * 3, 8) == [0, 0, 0]


def test_groups_given_rank_by_rank(comm):
    """[parallel] groups (what a recovery sets: survivors stay in their groups) replaces
    group_size's rule; the groups are numbered by their lowest rank."""
    colors = [(comm.size - 1 - r) // 2 for r in range(comm.size)]
    want = group_colors(colors, 0)
    g = make_groups(comm, 2, colors=colors)
    assert (g.index, g.count) == (want[comm.rank], max(want) + 1)
    assert g.members == tuple(r for r in range(comm.size) if want[r] == want[comm.rank])
    with pytest.raises(ValueError, match=f"the group of each of the {comm.size} ranks"):
        make_groups(comm, 0, colors=[0] * (comm.size + 1))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_one_inner_step_with_outer_sgd_lr_1_is_data_parallel(comm, momentum):
    """H = 1, outer lr 1, no outer momentum: sum_g w_g (theta - theta_g) = lr * the global
    mean gradient, so every step is the dp step (inner SGD, with momentum too)."""
    steps, data = 6, batches(6)
    optim = {"name": "sgd", "lr": 0.1, "hyper": {"momentum": momentum, "weight_decay": 1e-4}}
    dl = build_strategy(config("diloco", optim, steps, group_size=2, sync_every=1, outer_lr=1.0,
                                outer_momentum=0.0), comm, META)
    dp = build_strategy(config("dp", optim, steps), comm, META)
    lo, n = chunk(BATCH, comm.rank, comm.size)
    losses = []
    for x, y in data:
        a = dl.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)
        b = dp.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)
        losses.append((a["loss"], b["loss"]))
        assert a["synced"] and a["count"] == b["count"] == BATCH
    diff = float(np.max(np.abs(dl.inner.params.data - dp.params.data)))
    assert _agree(comm, diff < 1e-6), diff
    assert np.allclose(*zip(*losses), rtol=1e-6)
    assert np.array_equal(dl.outer.theta, dl.inner.params.data)
    dl.close()
    dp.close()


@pytest.mark.parametrize("fragments", [1, 2])
def test_local_sgd_is_the_average_of_independent_runs_at_each_sync(comm, fragments):
    """Each group of 2 trains alone (AdamW, its own state) for H steps; then every rank holds
    the groups' average weighted by their rows, and the groups go on from it. Streaming
    (2 fragments): each fragment is averaged at its own steps, fragment f every H steps from
    f * H // 2 (fragment 0 from H), all at the last step."""
    steps, sync = 7, 3
    optim = {"name": "adamw", "lr": 0.01, "hyper": {"weight_decay": 0.01}}
    cfg = config("local_sgd", optim, steps, group_size=2, sync_every=sync, outer_fragments=fragments)
    ls = build_strategy(cfg, comm, META)
    colors = group_colors([0] * comm.size, 2)
    groups = max(colors) + 1
    rows = [[r for r in range(comm.size) if colors[r] == g] for g in range(groups)]
    spans = [(chunk(BATCH, rs[0], comm.size)[0], sum(chunk(BATCH, r, comm.size)[1] for r in rs)) for rs in rows]
    self_comm = Communicator(MPI.COMM_SELF)
    refs = [build_strategy(config("dp", optim, steps), self_comm, META) for _ in range(groups)]
    lo, n = chunk(BATCH, comm.rank, comm.size)
    worst = 0.0
    for step, (x, y) in enumerate(batches(steps), start=1):
        m = ls.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)
        for ref, (a, k) in zip(refs, spans):
            ref.train_step(x[a:a + k], y[a:a + k], global_count=k)
        first = [f * sync // fragments or sync for f in range(fragments)]
        due = [f for f in range(fragments) if step == steps or (step >= first[f] and (step - first[f]) % sync == 0)]
        assert m.get("fragments", []) == due and m["synced"] == bool(due)
        avg = sum(ref.params.data.astype(np.float64) * k for ref, (_, k) in zip(refs, spans)) / BATCH
        for f in due:
            lo_f, hi_f = ls.outer.spans[f]
            for ref in refs:
                ref.params.data[lo_f:hi_f] = avg[lo_f:hi_f]
        mine = refs[colors[comm.rank]].params.data     # off its steps, a fragment is the group's own
        worst = max(worst, float(np.max(np.abs(ls.inner.params.data - mine))))
    assert _agree(comm, worst < 1e-6), worst
    for ref in refs:
        ref.close()
    self_comm.free()
    ls.close()


@pytest.mark.parametrize("outer", [{}, {"outer_compression": "sign"},
                                   {"outer_fragments": 2, "outer_compression": "sign"}])
def test_a_checkpoint_written_mid_round_resumes_the_same_trajectory(comm, shared_dir, outer):
    """The straight run saves at step 6 (two steps into the second round of 4) and 11; from
    step 6 the resumed run gives the same losses and final model, so theta_outer, the outer
    momentum, each group's inner parameters and AdamW moments, the round's sample counts
    and the outer exchange's residuals all carried over (streaming: per fragment)."""
    straight = run(loop_config(shared_dir, "straight", False, **outer), comm)
    if comm.rank == 0:
        os.remove(os.path.join(shared_dir, "ckpt", "ckpt-00000011.h5"))
    comm.comm.Barrier()
    resumed = run(loop_config(shared_dir, "resumed", True, **outer), comm)
    if comm.rank == 0:
        a, b = (read_metrics(os.path.join(shared_dir, n, "metrics.jsonl")) for n in ("resumed", "straight"))
        assert [r["step"] for r in a if r["event"] == "step"] == list(range(7, 12))
        assert [r["loss"] for r in a if r["event"] == "step"] == \
            [r["loss"] for r in b if r["event"] == "step" and r["step"] > 6]
    assert resumed["test_loss"] == straight["test_loss"]


def _rows(source, prefix: str, layout, row: int) -> np.ndarray:
    """Row `row` of the checkpoint's (rows, *shape) tensors "<prefix>/<name>", flat."""
    return np.concatenate([np.asarray(source.read(f"{prefix}/{seg.name}", row * seg.size, seg.size))
                           for seg in layout.segments])


@pytest.mark.parametrize("same_groups", [True, False])
def test_a_mid_round_checkpoint_resumes_at_another_world_size(comm, shared_dir, same_groups):
    """Written at p ranks in groups of 2 at step 6 (two steps into a round of 4) and read
    at another world size: theta_outer, the outer momentum and the step within the round
    carry over. With as many groups (one rank each) every group goes on from its own inner
    parameters (and where the groups read the same rows, the losses are the written run's);
    with another number (p groups of one) from theta_outer; either way the next sync comes
    at step 8, as it would have."""
    run(loop_config(shared_dir, "write", False), comm)
    if comm.rank == 0:
        os.remove(os.path.join(shared_dir, "ckpt", "ckpt-00000011.h5"))
    groups = -(-comm.size // 2)
    size = groups if same_groups else comm.size
    sub = comm.split(color=int(comm.rank < size))
    if comm.rank < size:
        cfg = loop_config(shared_dir, "read", True, group_size=1)
        cfg["job"]["total_steps"] = 11
        s = build_strategy(cfg, sub, META)
        same = s.groups.count == groups            # also with "another number" at one rank
        assert same == same_groups or comm.size == 1
        with CheckpointManager(os.path.join(shared_dir, "ckpt"), comm=sub).open_latest() as src:
            s.load_state_dict(src)
            theta, momentum = (np.empty(s.layout.numel, np.float32) for _ in range(2))
            read_flat(src, "params", s.layout, theta)
            read_flat(src, "optim/outer_momentum_buffer", s.layout, momentum)
            inner = _rows(src, "diloco/params", s.layout, s.groups.index) if same else theta
        assert (s.step, s.round_starts) == (6, [4])
        assert np.array_equal(s.outer.theta, theta) and np.abs(momentum).max() > 0
        assert np.array_equal(s.outer.state_buffers()["momentum_buffer"], momentum)
        assert np.array_equal(s.inner.params.data, inner)
        lo, n = chunk(BATCH, sub.rank, sub.size)
        synced = [s.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)["synced"] for x, y in batches(2)]
        assert synced == [False, True]
        s.close()
        # where each group reads the same rows at both sizes, the same trajectory (the
        # inner sums run over other ranks: equal up to rounding)
        write = [chunk(BATCH, r, comm.size) for r in range(comm.size)]
        aligned = same and all(chunk(BATCH, g, size) == (write[2 * g][0], sum(n for _, n in write[2 * g:2 * g + 2]))
                               for g in range(groups))
        if aligned:
            run(loop_config(shared_dir, "read", True, group_size=1), sub)
            if sub.rank == 0:
                a, b = (read_metrics(os.path.join(shared_dir, n, "metrics.jsonl")) for n in ("read", "write"))
                assert np.allclose([r["loss"] for r in a if r["event"] == "step"],
                                   [r["loss"] for r in b if r["event"] == "step" and r["step"] > 6], rtol=1e-5)


def test_outer_nesterov_moves_theta_outer_past_the_average(comm):
    """DiLoCo's outer step with momentum differs from averaging from the second sync on
    (the first Nesterov step is lr * (1 + momentum) * delta), and every rank agrees."""
    optim = {"name": "sgd", "lr": 0.1}
    x, y = batches(1)[0]
    lo, n = chunk(BATCH, comm.rank, comm.size)
    out = []
    for strategy, extra in (("diloco", {"outer_lr": 0.7, "outer_momentum": 0.9}), ("local_sgd", {})):
        s = build_strategy(config(strategy, optim, 4, group_size=2, sync_every=2, **extra), comm, META)
        start = s.outer.theta.copy()
        s.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)
        s.train_step(x[lo:lo + n], y[lo:lo + n], global_count=BATCH)
        out.append(s.outer.theta - start)
        s.close()
    diloco, local = out
    assert np.allclose(diloco, 0.7 * 1.9 * local, rtol=1e-4, atol=1e-7)
    assert comm.comm.allreduce(float(diloco.sum())) == pytest.approx(comm.size * float(diloco.sum()), rel=1e-12)


def test_config_errors_name_the_outer_options():
    with pytest.raises(ConfigError, match="compress the exchange between groups with outer_compression"):
        validate({"parallel": {"strategy": "diloco", "compression": "fp16"}})
    with pytest.raises(ConfigError, match="outer_lr applies to strategy = 'diloco' or 'diloco_async'"):
        validate({"parallel": {"strategy": "local_sgd", "outer_lr": 0.5}})
    with pytest.raises(ConfigError, match="sync_every applies to strategy = 'diloco' or 'local_sgd' or 'diloco_async'"):
        validate({"parallel": {"strategy": "dp", "sync_every": 5}})
    with pytest.raises(ConfigError, match="outer_compression = 'nope'"):
        validate({"parallel": {"strategy": "diloco", "outer_compression": "nope"}})
    with pytest.raises(ConfigError, match="groups has 3 entries: give the group of each of the 4 ranks"):
        validate({"parallel": {"strategy": "local_sgd", "groups": [0, 0, 1]}}, world_size=4)
    with pytest.raises(ConfigError, match="groups applies to strategy = 'diloco' or 'local_sgd'"):
        validate({"parallel": {"strategy": "dp", "groups": [0]}})
    with pytest.raises(ConfigError, match="a list of integers >= 0"):
        validate({"parallel": {"strategy": "diloco", "groups": [0, -1]}})
