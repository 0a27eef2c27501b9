"""Three plain torch training scripts converted to mpidist.torch the way docs/TORCH.md shows,
each checked at any rank count against one process on the global batch (1e-5 relative),
with a wrapped torch optimizer and with mpidist's fused one:

- mnist:   pytorch/examples' mnist/main.py shaped (conv net, Adadelta or fused SGD, StepLR
           on the DistributedOptimizer, clip_grad_norm_ after synchronize(), a
           DistributedSampler with set_epoch);
- gpt:     the GPT of jobs/torch_gpt.py with AdamW, no weight decay on biases and norms,
           OneCycleLR (which cycles betas too) and accumulation under no_sync();
- branchy: a frozen embedding and a branch that odd steps do not use (no gradient there,
           so torch's optimizers skip it).
"""
import contextlib

import pytest

torch = pytest.importorskip("torch", reason="mpidist.torch needs PyTorch (the [torch] extra)")

import torch.nn.functional as F                                 # noqa: E402
from torch import nn                                            # noqa: E402
from torch.utils.data import DataLoader, TensorDataset          # noqa: E402
from torch.utils.data.distributed import DistributedSampler     # noqa: E402

import mpidist.torch as mt                                      # noqa: E402
from mpidist.torch.models import GPT                            # noqa: E402

STEPS, PER_RANK = 4, 2


def close_params(m1, m2, rtol=1e-5):
    """Names of the parameters that differ by more than rtol of the tensor's largest entry."""
    bad = []
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        a, b = p.detach().double(), q.detach().double()
        if float((a - b).abs().max()) > rtol * max(1e-3, float(b.abs().max())):
            bad.append(n)
    return bad


def mine(t, comm):
    """This rank's rows of a global batch (all of it for one process)."""
    return t if comm is None else t[PER_RANK * comm.rank:PER_RANK * (comm.rank + 1)]


def convert(model, plain_opt, comm, fused=None, **kw):
    """The script's optimizer: as it is (comm None), or mpidist's around it."""
    if comm is None:
        return plain_opt
    if fused is None:
        return mt.DistributedOptimizer(model, plain_opt, comm=comm, bucket_mb=1e-3, **kw)
    name, hyper, groups = fused
    return mt.DistributedOptimizer(model, name, comm=comm, bucket_mb=1e-3,
                                   param_groups=groups, **hyper, **kw)


# ---------------------------------------------------------------- mnist/main.py shaped
class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 8, 3)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return F.log_softmax(self.fc(torch.flatten(x, 1)), dim=1)


def mnist(comm, fused, world):
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(STEPS * PER_RANK * 4, 1, 12, 12, generator=g),
                         torch.randint(0, 10, (STEPS * PER_RANK * 4,), generator=g))
    torch.manual_seed(0)
    model = ConvNet()
    if fused:
        plain = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = convert(model, plain, comm, ("sgd", dict(lr=0.05, momentum=0.9), None))
    else:
        opt = convert(model, torch.optim.Adadelta(model.parameters(), lr=1.0), comm)
    # one process: the whole permutation; ranks: every world-th index of it
    sampler = (DistributedSampler(data, num_replicas=1, rank=0, seed=7) if comm is None
               else mt.DistributedSampler(data, comm=comm, seed=7))
    loader = DataLoader(data, batch_size=PER_RANK * (world if comm is None else 1),
                        sampler=sampler)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in list(loader)[:STEPS // 2]:
            opt.zero_grad()
            F.nll_loss(model(x), y).backward()
            if comm is not None:
                opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        scheduler.step()
    return model, opt


# ---------------------------------------------------------------- GPT, AdamW, OneCycleLR
def gpt(comm, fused, world):
    torch.manual_seed(0)
    model = GPT(block=8, dim=16, layers=2, heads=2, vocab=32)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    # eps 1e-3: the key rows of each qkv bias get only rounding noise as their gradient
    # (softmax ignores a shift), which Adam with a tiny eps turns into whole steps that
    # follow the noise, different for any other order of summation
    plain = torch.optim.AdamW(groups, lr=1e-2, eps=1e-3)
    opt = convert(model, plain, comm,
                  ("adamw", dict(lr=1e-2, eps=1e-3), groups) if fused else None)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=STEPS)
    accumulate = 2
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accumulate):
            g = torch.Generator().manual_seed(100 * step + micro)
            x = mine(torch.randint(0, 32, (PER_RANK * world, 9), generator=g), comm)
            last = micro == accumulate - 1
            with opt.no_sync() if comm is not None and not last else contextlib.nullcontext():
                logits = model(x[:, :-1])
                F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        scheduler.step()
    return model, opt


# ---------------------------------------------------------------- frozen and unused
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.emb.weight.requires_grad_(False)
        self.trunk, self.branch = nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, idx, use_branch):
        h = torch.tanh(self.trunk(self.emb(idx).mean(1)))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def branchy(comm, fused, world):
    torch.manual_seed(0)
    model = Branchy()
    trainable = [p for p in model.parameters() if p.requires_grad]
    if fused:
        hyper = dict(lr=0.1, momentum=0.9, weight_decay=1e-2)
        opt = convert(model, torch.optim.SGD(trainable, **hyper), comm, ("sgd", hyper, None))
    else:
        opt = convert(model, torch.optim.Adam(trainable, lr=1e-2, weight_decay=1e-2), comm)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        idx = mine(torch.randint(0, 20, (PER_RANK * world, 5), generator=g), comm)
        y = mine(torch.randint(0, 3, (PER_RANK * world,), generator=g), comm)
        opt.zero_grad()
        F.cross_entropy(model(idx, use_branch=step % 2 == 0), y).backward()
        opt.step()
    return model, opt


SCRIPTS = {"mnist": mnist, "gpt": gpt, "branchy": branchy}


@pytest.mark.parametrize("fused", [False, True], ids=["torch-optimizer", "fused"])
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_matches_one_process(comm, script, fused):
    ref, _ = SCRIPTS[script](None, fused, comm.size)
    got, opt = SCRIPTS[script](comm, fused, comm.size)
    try:
        assert not close_params(got, ref), f"parameters differ: {close_params(got, ref)}"
        if script == "branchy":
            assert torch.equal(got.emb.weight, ref.emb.weight)       # frozen stays
    finally:
        opt.close()
