"""fault_tolerance = "shrink" with diloco and local_sgd: the state a recovery gives the
survivors, taken without a failure (tests/ft/test_shrink.py kills ranks under ULFM). The
last rank plays the dead one: it sits out while the others, on a communicator of their
own, agree on the state, rebuild the strategy and train on to the next outer step. At 2
ranks and more."""
import mpi4py
import numpy as np
import pytest

from mpidist import ulfm
from mpidist.diloco import group_colors
from mpidist.engine.strategies import build_strategy
from mpidist.ft.recovery import Resilience, replica
from mpidist.partition import chunk
from tests.engine.diloco_case import ADAMW, BATCH, META, batches, config

H, STEPS, FAILED_AFTER = 4, 12, 6       # the failure halfway through the second round

pytestmark = pytest.mark.mpi(min_size=2)


def rows(comm, x, y):
    lo, n = chunk(len(x), comm.rank, comm.size)
    return x[lo:lo + n], y[lo:lo + n]


@pytest.mark.parametrize("group_size", [1, 2])
@pytest.mark.parametrize("strategy", ["diloco", "local_sgd"])
def test_survivors_keep_their_groups_progress_and_drop_the_lost_group(comm, monkeypatch, strategy, group_size):
    """Every survivor keeps theta_outer, its momentum and its group's inner state bit for bit
    (group_size 2: a member behind by a step gets its mate's); a group whose every rank is
    lost is gone, and the next outer step weighs only the surviving groups, their weights
    summing to 1 (local SGD: theta_outer is then their weighted average)."""
    monkeypatch.setattr(ulfm, "active", lambda: True)
    monkeypatch.setattr(mpi4py.rc, "fast_reduce", False)
    cfg = config(strategy, ADAMW, STEPS, group_size=group_size, sync_every=H)
    data = batches(STEPS)
    s = build_strategy(cfg, comm, META)
    early = None
    for x, y in data[:FAILED_AFTER]:
        early = replica(s)               # the state one step before the failure
        s.train_step(*rows(comm, x, y), global_count=BATCH)
    lost = comm.size - 1
    old = group_colors([0] * comm.size, group_size)
    survivors = comm.split(color=int(comm.rank == lost))
    if comm.rank != lost:
        res = Resilience(cfg, survivors)
        res.attach(s, None)
        # a member of a 2-rank group that missed the last inner step (its mate did it)
        behind = group_size == 2 and old.count(old[1]) == 2 and lost != 1 and comm.rank == 1
        if behind:
            res._holder = early
        state = res._agree()
        # the survivors stay in their groups; a group with no survivor is dropped
        assert res._groups == group_colors(old[:lost], 0)
        dropped = [old[lost]] if old.count(old[lost]) == 1 else []
        assert res._detail == {"groups": max(res._groups) + 1, "dropped_groups": dropped,
                               "inner_steps": [FAILED_AFTER] * (max(res._groups) + 1)}
        p = {**cfg["parallel"], "groups": res._groups}
        t = build_strategy({**cfg, "parallel": p}, survivors, META)
        t.load_state_dict(state)
        # 1. theta_outer, its momentum and the inner state (the mate's, when behind) kept
        kept = [state.step == FAILED_AFTER,
                t.groups.members == tuple(r for r in range(lost) if old[r] == old[comm.rank]),
                np.array_equal(t.outer.theta, s.outer.theta),
                np.array_equal(t.inner.params.data, s.inner.params.data),
                (t.step, t.inner.step, t.round_starts) == (FAILED_AFTER, FAILED_AFTER, s.round_starts)]
        kept += [np.array_equal(t.outer.state_buffers()[k], b) for k, b in s.outer.state_buffers().items()]
        kept += [np.array_equal(t.inner.optimizer.state_buffers()[k], b)
                 for k, b in s.inner.optimizer.state_buffers().items()]
        assert survivors.all(all(kept)), kept
        # 2. on to the next outer step, which sees the surviving groups only
        seen = {}
        sync = t.outer.sync

        def watch(params, weight, *args, **kwargs):
            seen.update(theta=params.copy(), weight=float(np.ravel(weight)[0]))
            return sync(params, weight, *args, **kwargs)

        t.outer.sync = watch
        for x, y in data[FAILED_AFTER:2 * H]:
            t.train_step(*rows(survivors, x, y), global_count=BATCH)
        leaders = survivors.comm.allgather((seen["weight"], seen["theta"]) if t.groups.is_leader else None)
        leaders = [w for w in leaders if w is not None]
        assert t.step == 2 * H and len(leaders) == t.groups.count
        assert abs(sum(w for w, _ in leaders) - 1) < 1e-12, [w for w, _ in leaders]
        if strategy == "local_sgd":      # theta_outer: the surviving groups' weighted average
            average = sum(w * theta.astype(np.float64) for w, theta in leaders)
            assert np.allclose(t.outer.theta, average, atol=1e-6)
        assert np.all(np.isfinite(t.outer.theta))
        t.close()
    s.close()
