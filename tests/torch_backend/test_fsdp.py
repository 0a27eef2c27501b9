"""FSDP2 (fully_shard) over "mpidist" trains as DDP does, and torch.distributed.checkpoint
saves and loads its sharded state."""
import pytest

torch = pytest.importorskip("torch", reason="needs torch (scripts/setup_env.sh installs it)")
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

fsdp = pytest.importorskip("torch.distributed.fsdp", reason="needs FSDP2 (torch >= 2.6)")


def _model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24),
                               torch.nn.Tanh(), torch.nn.Linear(24, 3))


def _sharded():
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fsdp.fully_shard(layer)
    return fsdp.fully_shard(model)


def _steps(model, n):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(300 + dist.get_rank())
    for _ in range(n):
        x, y = torch.randn(6, 12, generator=gen), torch.randn(6, 3, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return opt


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def test_fsdp2_equals_ddp(groups):
    sharded = _sharded()
    _steps(sharded, 10)
    ddp = DDP(_model())
    _steps(ddp, 10)
    for a, b in zip(sharded.parameters(), ddp.parameters()):
        torch.testing.assert_close(_full(a), b.detach(), rtol=1e-5, atol=1e-6)


def test_checkpoint_save_and_load(groups, shared_dir):
    import torch.distributed.checkpoint as dcp
    model = _sharded()
    opt = _steps(model, 2)
    saved = [_full(p).clone() for p in model.parameters()]
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=shared_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=shared_dir)
    model.load_state_dict(state["model"])
    for a, b in zip(model.parameters(), saved):
        assert torch.equal(_full(a), b)
