"""DistributedDataParallel over "mpidist" reaches the parameters DDP over gloo reaches."""
import pytest

torch = pytest.importorskip("torch", reason="needs torch (scripts/setup_env.sh installs it)")
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def _model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _train(group, steps: int, **ddp_kwargs):
    """DDP over `group`: AdamW steps on rank-dependent data; the final parameters."""
    model = DDP(_model(), process_group=group, **ddp_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        y = torch.randn(8, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.002])    # one bucket; several in flight
def test_ddp_equals_gloo_after_20_adamw_steps(groups, bucket_cap_mb):
    mpidist_pg, gloo_pg = groups
    ours = _train(mpidist_pg, 20, bucket_cap_mb=bucket_cap_mb)
    ref = _train(gloo_pg, 20, bucket_cap_mb=bucket_cap_mb)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # and every rank holds the same parameters
    flat = torch.cat([p.reshape(-1) for p in ours])
    first = flat.clone()
    dist.broadcast(first, 0)
    assert torch.equal(flat, first)


def test_ddp_without_explicit_group_runs_on_mpidist(groups):
    """The default group is "mpidist": DDP(model) with no process_group uses it."""
    assert dist.get_backend() == "mpidist"
    params = _train(None, 3)
    assert all(torch.isfinite(p).all() for p in params)
