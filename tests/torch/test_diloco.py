"""mpidist.torch.DiLoCo against a hand computation: a quadratic loss per rank, whose
gradient is known in closed form, trained by inner SGD data parallel within groups of 2
and outer Nesterov SGD across them, at any rank count."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="mpidist.torch needs PyTorch (the [torch] extra)")

import mpidist.torch as mt                                     # noqa: E402
from mpidist.diloco import group_colors                        # noqa: E402

DIM, LR, H, SYNCS = 5, 0.1, 3, 3
OUTER_LR, OUTER_M = 0.7, 0.9


def targets(size):
    """c_r: rank r's loss is 0.5 * ||w - c_r||^2 (gradient w - c_r)."""
    return np.random.default_rng(7).standard_normal((size, DIM))


def reference(size, w0):
    """The DiLoCo trajectory by hand: theta_outer after each sync."""
    colors = group_colors([0] * size, 2)
    c = targets(size)
    theta, v, out = w0.astype(np.float64), np.zeros(DIM), []
    for sync in range(SYNCS):
        delta = np.zeros(DIM)
        for g in range(max(colors) + 1):
            ranks = [r for r in range(size) if colors[r] == g]
            w = theta.copy()
            for _ in range(H):                        # inner SGD on the group's mean gradient
                w -= LR * (w - c[ranks].mean(axis=0))
            delta += len(ranks) / size * (theta - w)  # weighted by the group's share of ranks
        v = delta if sync == 0 else OUTER_M * v + delta      # torch's Nesterov SGD
        theta = theta - OUTER_LR * (delta + OUTER_M * v)
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
