"""mpidist.torch.DiLoCo against a hand computation: a quadratic loss per rank, whose
gradient is known in closed form, trained by inner SGD data parallel within groups of 2
and outer Nesterov SGD across them, at any rank count."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="mpidist.torch needs PyTorch (the [torch] extra)")

import mpidist.torch as mt                                     # noqa: E402
from mpidist.torch.diloco import AsyncDiLoCo, split_servers   # noqa: E402
from mpidist.diloco import group_colors                        # noqa: E402

DIM, LR, H, SYNCS = 5, 0.1, 3, 3
OUTER_LR, OUTER_M = 0.7, 0.9


def targets(size):
    """c_r: rank r's loss is 0.5 * ||w - c_r||^2 (gradient w - c_r)."""
    return np.random.default_rng(7).standard_normal((size, DIM))


def reference(size, w0, steps=H * SYNCS, due=lambda t: t % H == 0, group_size=2):
    """The DiLoCo trajectory by hand: theta_outer after each outer step, which come after
    the inner steps t where due(t)."""
    colors = group_colors([0] * size, group_size)
    c = targets(size)
    groups = [[r for r in range(size) if colors[r] == g] for g in range(max(colors) + 1)]
    theta, v, out = w0.astype(np.float64), None, []
    ws = [theta.copy() for _ in groups]
    for t in range(1, steps + 1):
        for w, ranks in zip(ws, groups):                  # inner SGD on the group's mean gradient
            w -= LR * (w - c[ranks].mean(axis=0))
        if due(t):
            delta = sum(len(ranks) / size * (theta - w) for w, ranks in zip(ws, groups))   # by share of ranks
            v = delta if v is None else OUTER_M * v + delta      # torch's Nesterov SGD
            theta = theta - OUTER_LR * (delta + OUTER_M * v)
            ws = [theta.copy() for _ in groups]
            out.append(theta.copy())
    return out


def test_diloco_follows_the_hand_computed_outer_trajectory(comm):
    torch.manual_seed(comm.rank)                      # different starts: rank 0's wins
    w = torch.nn.Parameter(torch.randn(DIM))
    groups = mt.make_groups(comm, group_size=2)
    inner = mt.DistributedOptimizer([("w", w)], "sgd", lr=LR, comm=groups.group)
    opt = mt.DiLoCo([("w", w)], inner, sync_every=H, outer_lr=OUTER_LR, outer_momentum=OUTER_M,
                    groups=groups)
    start = opt.outer.theta.copy()
    expected = reference(comm.size, start)
    c = torch.tensor(targets(comm.size)[comm.rank], dtype=torch.float32)
    worst = 0.0
    for sync in range(SYNCS):
        for _ in range(H):
            opt.zero_grad()
            (0.5 * ((w - c) ** 2).sum()).backward()
            opt.step()
        assert opt.step_in_round == 0 and opt.last_sync is not None
        worst = max(worst, float(np.max(np.abs(w.detach().numpy() - expected[sync]))))
    assert comm.all(worst < 1e-5), worst
    state = opt.state_dict()
    assert state["outer_syncs"] == SYNCS and np.allclose(state["theta_outer"].numpy(), expected[-1], atol=1e-5)
    inner.close()


def test_diloco_checks_its_settings(comm):
    w = torch.nn.Parameter(torch.zeros(DIM))
    inner = torch.optim.SGD([w], lr=LR)
    with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
        mt.DiLoCo([w], inner, sync_every=0, comm=comm)
    with pytest.raises(TypeError, match="inner_optimizer must be a torch optimizer"):
        mt.DiLoCo([w], "sgd", sync_every=2, comm=comm)


def test_streaming_diloco_steps_each_fragment_on_its_own_schedule(comm):
    """Two tensors in two fragments: w has its outer step every H steps, b every H steps from
    step H // 2; each follows the hand-computed DiLoCo trajectory of its own schedule (the
    loss is separable), and w's is the plain DiLoCo one above."""
    torch.manual_seed(comm.rank)
    w, b = torch.nn.Parameter(torch.randn(DIM)), torch.nn.Parameter(torch.randn(DIM))
    groups = mt.make_groups(comm, group_size=2)
    inner = mt.DistributedOptimizer([("w", w), ("b", b)], "sgd", lr=LR, comm=groups.group)
    opt = mt.DiLoCo([("w", w), ("b", b)], inner, sync_every=H, outer_lr=OUTER_LR, outer_momentum=OUTER_M,
                    groups=groups, fragments=2)
    assert opt.outer.spans == [(0, DIM), (DIM, 2 * DIM)]
    start = opt.outer.theta.copy()
    steps = H * SYNCS

    def due_b(t):
        return t % H == H // 2

    expected_w, expected_b = reference(comm.size, start[:DIM]), reference(comm.size, start[DIM:], steps, due_b)
    c = torch.tensor(targets(comm.size)[comm.rank], dtype=torch.float32)
    worst, k = 0.0, 0
    for t in range(1, steps + 1):
        opt.zero_grad()
        (0.5 * ((w - c) ** 2).sum() + 0.5 * ((b - c) ** 2).sum()).backward()
        opt.step()
        if t % H == 0:
            worst = max(worst, float(np.max(np.abs(w.detach().numpy() - expected_w[t // H - 1]))))
        if due_b(t):
            worst = max(worst, float(np.max(np.abs(b.detach().numpy() - expected_b[k]))))
            k += 1
    assert k == len(expected_b) == SYNCS and opt.round_starts == [steps, steps - H + H // 2]
    assert comm.all(worst < 1e-5), worst
    # finish(): b's open round ends now, with an outer step as if one were due at the last
    # step; w's round is over and w stays; afterwards every rank holds theta_outer
    final_b = reference(comm.size, start[DIM:], steps, lambda t: due_b(t) or t == steps)[-1]
    finished = opt.finish()
    assert opt.round_starts == [steps, steps] and finished is opt.last_sync
    everyone = comm.comm.allgather(np.concatenate([w.detach().numpy(), b.detach().numpy()]))
    assert all(np.array_equal(v, everyone[0]) for v in everyone)
    assert np.allclose(everyone[0], opt.outer.theta)
    assert comm.all(np.allclose(w.detach().numpy(), expected_w[-1], atol=1e-5) and
                    np.allclose(b.detach().numpy(), final_b, atol=1e-5))
    assert opt.finish() is finished            # nothing left open: no further sync
    inner.close()


@pytest.mark.mpi(min_size=2)
def test_async_diloco_with_one_group_follows_the_hand_computed_trajectory(comm):
    """A server and every other rank in one group: each round pushes, the server's delayed
    Nesterov (one push per momentum step) makes DiLoCo's outer step, and after the budget of
    rounds every rank, the server too, holds the hand-computed theta_outer."""
    topo = split_servers(comm, servers=1, group_size=comm.size - 1)
    torch.manual_seed(comm.rank)
    w = torch.nn.Parameter(torch.randn(DIM))
    inner = None if topo.is_server else mt.DistributedOptimizer([("w", w)], "sgd", lr=LR, comm=topo.groups.group)
    opt = AsyncDiLoCo([("w", w)], inner, topo, sync_every=H, rounds=SYNCS, outer_lr=OUTER_LR,
                      outer_momentum=OUTER_M)
    workers = comm.size - 1
    expected = reference(workers, opt.flat.copy(), group_size=workers)[-1]
    if opt.is_server:
        opt.serve()
    else:
        c = torch.tensor(targets(workers)[topo.groups.group.rank], dtype=torch.float32)
        while not opt.done:
            opt.zero_grad()
            (0.5 * ((w - c) ** 2).sum()).backward()
            opt.step()
    rounds = opt.report()["rounds"]
    opt.close()
    assert rounds == [SYNCS]
    assert comm.all(np.allclose(w.detach().numpy(), expected, atol=1e-5)), (w, expected)
    if inner is not None:
        inner.close()

