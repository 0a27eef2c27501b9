"""torch.distributed.pipelining over "mpidist": the GPipe, 1F1B, Interleaved1F1B and
ZBVZeroBubble schedules, whose stages talk by the group's send/recv, give the losses and
gradients of the same schedule over gloo."""
import pytest

torch = pytest.importorskip("torch", reason="needs torch (scripts/setup_env.sh installs it)")
import torch.distributed as dist  # noqa: E402

pipelining = pytest.importorskip("torch.distributed.pipelining",
                                 reason="needs torch.distributed.pipelining")
pytestmark = [pytest.mark.mpi(min_size=2),
              pytest.mark.filterwarnings("ignore::UserWarning")]
WIDTH = 8


def _stage_module(index):
    torch.manual_seed(1000 + index)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())


def _stage_indices(name, size, rank):
    """This rank's stages: one (GPipe, 1F1B), a loop of two (Interleaved1F1B), or a V of
    two (ZBVZeroBubble: the last stage back on rank 0)."""
    if name in ("GPipe", "1F1B"):
        return [rank], size
    if name == "Interleaved1F1B":
        return [rank, rank + size], 2 * size
    return [rank, 2 * size - 1 - rank], 2 * size


def _run(name, group):
    """One schedule step over `group`: (the loss per microbatch where this rank has the last
    stage, every gradient of this rank's stages)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    indices, n_stages = _stage_indices(name, size, rank)
    modules = [_stage_module(i) for i in indices]
    stages = [pipelining.PipelineStage(m, i, n_stages, torch.device("cpu"), group=group)
              for m, i in zip(modules, indices)]
    loss_fn = torch.nn.functional.mse_loss
    n_micro = 2 * size
    cls = {"GPipe": pipelining.ScheduleGPipe, "1F1B": pipelining.Schedule1F1B,
           "Interleaved1F1B": pipelining.ScheduleInterleaved1F1B,
           "ZBVZeroBubble": pipelining.ScheduleZBVZeroBubble}[name]
    schedule = cls(stages[0] if len(stages) == 1 else stages, n_micro, loss_fn=loss_fn)
    gen = torch.Generator().manual_seed(5)
    batch = 2 * n_micro                          # microbatches of equal size
    x, y = torch.randn(batch, WIDTH, generator=gen), torch.randn(batch, WIDTH, generator=gen)
    losses = []
    schedule.step(*((x,) if 0 in indices else ()),
                  **(dict(target=y, losses=losses) if n_stages - 1 in indices else {}))
    grads = [p.grad.clone() for m in modules for p in m.parameters()]
    return [loss.detach() for loss in losses], grads


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_schedule_equals_gloo(groups, name):
    ours_losses, ours_grads = _run(name, groups[0])
    ref_losses, ref_grads = _run(name, groups[1])
    assert len(ours_losses) == len(ref_losses) and len(ours_grads) == len(ref_grads) > 0
    for a, b in zip(ours_losses + ours_grads, ref_losses + ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert all(g.abs().sum() > 0 for g in ours_grads)
