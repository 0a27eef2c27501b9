"""A torch script's own idioms on mpidist.torch: schedulers take the DistributedOptimizer,
param_groups writes reach the fused kernels, state_dict goes through torch.save, `.grad`
is the average (or the sum), a gradient changed before synchronize() fails on every rank,
a batch thrown away after backward is, autocast and torch.compile work, and the sampler shards
(threads per rank: tests/test_threads.py)."""
import io

import pytest

torch = pytest.importorskip("torch", reason="mpidist.torch needs PyTorch (the [torch] extra)")

import torch.nn.functional as F                                 # noqa: E402

import mpidist.torch as mt                                      # noqa: E402

PER_RANK = 3


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def data(step, size):
    g = torch.Generator().manual_seed(step)
    return torch.randn(PER_RANK * size, 6, generator=g), torch.randint(0, 3, (PER_RANK * size,),
                                                                         generator=g)


def mine(t, comm):
    return t[PER_RANK * comm.rank:PER_RANK * (comm.rank + 1)]


def train_step(comm, step, reference, distributed):
    """One step of (optimizer, model) pairs: the reference as one process on the global
    batch, the distributed one on this rank's share of it; returns the global batch."""
    x, y = data(step, comm.size)
    for (o, m), xs, ys in ((reference, x, y), (distributed, mine(x, comm), mine(y, comm))):
        o.zero_grad()
        F.cross_entropy(m(xs), ys).backward()
        o.step()
    return x, y


def assert_close(a, b, rtol=1e-5):
    a, b = a.detach().double(), b.detach().double()
    assert float((a - b).abs().max()) <= rtol * max(1e-3, float(b.abs().max())), (a, b)


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=4),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(o, [
        torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=1),
        torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9)], milestones=[1]),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0),
}


@pytest.mark.parametrize("fused", [False, True], ids=["torch-optimizer", "fused"])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_schedulers_drive_the_update(comm, name, fused):
    """Every scheduler takes the DistributedOptimizer and the weights follow its lr, as one
    process with the same scheduler on torch's SGD."""
    ref, model = make_model(), make_model()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    inner = "sgd" if fused else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = mt.DistributedOptimizer(model, inner, comm=comm,
                                  **(dict(lr=0.1, momentum=0.9) if fused else {}))
    assert isinstance(opt, torch.optim.Optimizer)
    rs, s = SCHEDULERS[name](ropt), SCHEDULERS[name](opt)
    for step in range(4):
        train_step(comm, step, (ropt, ref), (opt, model))
        loss = float(step % 2)             # a plateau for ReduceLROnPlateau
        rs.step(loss) if name == "ReduceLROnPlateau" else rs.step()
        s.step(loss) if name == "ReduceLROnPlateau" else s.step()
        assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q)
    opt.close()


def test_param_group_writes_reach_the_fused_kernels(comm):
    """lr, weight_decay and betas written between steps, and two groups (no decay on
    biases), give torch's AdamW's weights; lr 0 stops the weights."""
    ref, model = make_model(), make_model()

    def groups(m):
        return [{"params": [p for p in m.parameters() if p.dim() > 1], "weight_decay": 0.1},
                {"params": [p for p in m.parameters() if p.dim() == 1], "weight_decay": 0.0}]
    ropt = torch.optim.AdamW(groups(ref), lr=1e-2)
    opt = mt.DistributedOptimizer(model, "adamw", lr=1e-2, comm=comm, param_groups=groups(model))
    # (groups written, values): both groups, or the biases' alone (a pass of their own)
    writes = [((0, 1), {}), ((0, 1), {"lr": 5e-3, "betas": (0.8, 0.99)}),
              ((1,), {"lr": 2e-2, "betas": (0.5, 0.9)}), ((0, 1), {"weight_decay": 0.3}),
              ((0, 1), {"lr": 0.0})]
    for step, (which, write) in enumerate(writes):
        for o in (ropt, opt):
            for k in which:
                o.param_groups[k].update(write)
        before = [p.detach().clone() for p in model.parameters()]
        train_step(comm, step, (ropt, ref), (opt, model))
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p, q)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))   # lr 0
    opt.close()


@pytest.mark.parametrize("zero", [0, 1])
def test_state_dict_round_trips_through_torch_save(comm, zero):
    """state_dict -> torch.save -> torch.load (weights only) -> load_state_dict into a fresh
    model (ZeRO stage 2 there) continues as the uninterrupted run."""
    model, fresh = make_model(), make_model(seed=4)
    opt = mt.DistributedOptimizer(model, "adamw", lr=1e-2, comm=comm, zero=zero)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    def run(o, m, steps):
        for step in steps:
            x, y = data(step, comm.size)
            o.zero_grad()
            F.cross_entropy(m(mine(x, comm)), mine(y, comm)).backward()
            o.step()
    run(opt, model, range(2))
    sched.step()
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "model": model.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    again = mt.DistributedOptimizer(fresh, "adamw", lr=1.0, comm=comm, zero=2)
    fresh.load_state_dict(saved["model"])
    again.load_state_dict(saved["opt"])
    assert again.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 5e-3
    run(opt, model, range(2, 4))
    run(again, fresh, range(2, 4))
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert_close(p, q, 1e-6)
    opt.close()
    again.close()


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("op", ["avg", "sum"])
def test_grad_is_the_average_after_synchronize(comm, op, zero):
    """After synchronize() `.grad` is the mean (op="avg") or the sum over the ranks of
    each rank's gradient, at every ZeRO stage (stage 2 gathers its shards for it);
    clip_grad_norm_ sees that gradient and the step after it is one process's."""
    ref, model = make_model(), make_model()
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm, op=op, zero=zero)
    x, y = data(0, comm.size)
    F.cross_entropy(ref(x), y).backward()
    want = [p.grad * (comm.size if op == "sum" else 1) for p in ref.parameters()]
    opt.zero_grad()
    F.cross_entropy(model(mine(x, comm)), mine(y, comm)).backward()
    opt.synchronize()
    for p, g in zip(model.parameters(), want):
        assert_close(p.grad, g)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert_close(norm, torch.nn.utils.get_total_norm([g for g in want]))
    opt.step()
    for p, g in zip(ref.parameters(), want):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q)
    opt.close()


def wide_model(seed=0):
    """Wide enough for several buckets of bucket_mb=0.01 (10 KiB)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 3))


def sgd_pair(comm, fused):
    """(reference, its torch SGD, model, its DistributedOptimizer): momentum SGD on both,
    mpidist's fused kernel or the same torch SGD wrapped, buckets of 10 KiB."""
    ref, model = wide_model(), wide_model()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    inner = "sgd" if fused else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = mt.DistributedOptimizer(model, inner, comm=comm, bucket_mb=0.01,
                                  **(dict(lr=0.1, momentum=0.9) if fused else {}))
    return ref, ropt, model, opt


def change_grads(kind, model, loss, opt):
    """The DDP script's line between backward and step, before any synchronize()."""
    loss.backward()
    if kind == "clip_grad_norm_":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    else:
        p = next(model.parameters())
        p.grad = p.grad.clone()


@pytest.mark.parametrize("kind", ["clip_grad_norm_", "replaced"])
def test_changing_gradients_before_synchronize_fails_everywhere(comm, kind):
    """A DDP script's clip_grad_norm_ straight after backward, or a `.grad` replaced, would
    race the reduction that backward started: every rank raises, names synchronize(), takes
    no step, and the corrected script then trains as one process."""
    ref, ropt, model, opt = sgd_pair(comm, fused=False)
    assert len(opt.buckets.buckets) > 1
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data(0, comm.size)
    opt.zero_grad()
    change_grads(kind, model, F.cross_entropy(model(mine(x, comm)), mine(y, comm)), opt)
    with pytest.raises(RuntimeError, match=r"before synchronize\(\).*this step is not taken"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    for step in range(1, 3):
        x, y = data(step, comm.size)
        for o, m, xs, ys in ((ropt, ref, x, y), (opt, model, mine(x, comm), mine(y, comm))):
            o.zero_grad()
            F.cross_entropy(m(xs), ys).backward()
            if o is opt:
                opt.synchronize()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q)
    opt.close()


@pytest.mark.parametrize("fused", [False, True], ids=["torch-optimizer", "fused"])
def test_gradscaler_as_under_ddp(comm, fused):
    """DDP's mixed-precision loop unchanged, `scaler.scale(loss).backward();
    scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt); scaler.update()`, with no
    synchronize(): unscale_ waits for the average, and training equals one process, its
    scale growing alike."""
    ref, ropt, model, opt = sgd_pair(comm, fused)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2)
               for _ in range(2)]
    for step in range(4):
        x, y = data(step, comm.size)
        for o, m, s, xs, ys in ((ropt, ref, scalers[0], x, y),
                                (opt, model, scalers[1], mine(x, comm), mine(y, comm))):
            o.zero_grad()
            s.scale(F.cross_entropy(m(xs), ys)).backward()
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            s.step(o)
            s.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p, q)
    assert scalers[1].get_scale() == 2.0 ** 18
    opt.close()


@pytest.mark.parametrize("fused", [False, True], ids=["torch-optimizer", "fused"])
def test_zero_grad_after_backward_skips_the_step(comm, fused):
    """`loss.backward(); opt.zero_grad()` with no step (a batch thrown away) waits for the
    reductions that backward started before clearing: the next steps equal one process
    that skipped the same batches."""
    ref, ropt, model, opt = sgd_pair(comm, fused)
    for step in range(6):
        x, y = data(step, comm.size)
        for o, m, xs, ys in ((ropt, ref, x, y), (opt, model, mine(x, comm), mine(y, comm))):
            o.zero_grad(set_to_none=step % 4 < 2)
            F.cross_entropy(m(xs), ys).backward()
            if step % 2 == 0:
                o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q)
    opt.close()


@pytest.mark.parametrize("fused", [False, True], ids=["torch-optimizer", "fused"])
def test_join_trains_uneven_inputs_as_ddp(comm, fused):
    """Rank r has 2 + r batches. Inside join() the ranks that run out shadow the others: each
    step is one process's on the active ranks' batches averaged over all ranks (DDP's
    join()), and afterwards every rank holds the same parameters and momentum."""
    ref, ropt, model, opt = sgd_pair(comm, fused)
    steps = [2 + r for r in range(comm.size)]
    with opt.join():
        for step in range(steps[comm.rank]):
            x, y = data(step, comm.size)
            opt.zero_grad()
            F.cross_entropy(model(mine(x, comm)), mine(y, comm)).backward()
            opt.step()
    for step in range(max(steps)):
        x, y = data(step, comm.size)
        ropt.zero_grad()
        sum(F.cross_entropy(ref(x[PER_RANK * r:PER_RANK * (r + 1)]),
                            y[PER_RANK * r:PER_RANK * (r + 1)])
            for r in range(comm.size) if step < steps[r]).div(comm.size).backward()
        ropt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q)
    train_step(comm, 9, (ropt, ref), (opt, model))      # the momentum came along
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q)
    opt.close()


@pytest.mark.parametrize("settings", [dict(zero=1), dict(compression="fp16")])
def test_join_refused_where_a_joined_rank_is_needed(comm, settings):
    model = wide_model()
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm, **settings)
    with pytest.raises(ValueError, match="join\\(\\) is for data parallel"):
        with opt.join():
            pass
    opt.close()


def test_step_closure_updates_from_the_average(comm):
    """Inside step(closure) the wrapped torch optimizer's step sees the averaged `.grad`."""
    ref, model = make_model(), make_model()
    x, y = data(0, comm.size)
    F.cross_entropy(ref(x), y).backward()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    inner.register_step_pre_hook(
        lambda o, args, kw: seen.append([p.grad.clone() for p in model.parameters()]))
    opt = mt.DistributedOptimizer(model, inner, comm=comm)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(mine(x, comm)), mine(y, comm))
        loss.backward()
        return loss
    assert opt.step(closure) is not None
    for g, p in zip(seen[0], ref.parameters()):
        assert_close(g, p.grad)
    opt.close()


def test_autocast_bf16_and_compile(comm):
    """A bf16-autocast forward and a torch.compile'd model train as one process does."""
    ref, model = make_model(), make_model()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm)
    for step in range(2):
        x, y = data(step, comm.size)
        for o, m, xs, ys in ((ropt, ref, x, y), (opt, model, mine(x, comm), mine(y, comm))):
            o.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = m(xs)
            assert out.dtype == torch.bfloat16
            F.cross_entropy(out.float(), ys).backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q, 2e-2)           # bf16 rows computed in another batch shape
    try:
        compiled = torch.compile(model)
        compiled(mine(x, comm))
    except Exception as exc:               # inductor needs a C++ compiler
        opt.close()
        pytest.skip(f"torch.compile does not work here: {type(exc).__name__}")
    eager = make_model(seed=1)
    compiled_model = make_model(seed=1)
    eopt = torch.optim.SGD(eager.parameters(), lr=0.1)
    copt = mt.DistributedOptimizer(compiled_model, "sgd", lr=0.1, comm=comm)
    run = torch.compile(compiled_model)
    for step in range(2):
        train_step(comm, step, (eopt, eager), (copt, run))
    for p, q in zip(compiled_model.parameters(), eager.parameters()):
        assert_close(p, q)
    opt.close()
    copt.close()


@pytest.mark.parametrize("n, drop_last", [(10, False), (10, True), (12, False)])
def test_sampler_shards_every_epoch(comm, n, drop_last):
    """Every rank gets as many indices; together they cover the dataset (padded, or with
    the tail dropped); set_epoch gives a new permutation, the same on every rank."""
    data = list(range(n))
    s = mt.DistributedSampler(data, comm=comm, drop_last=drop_last, seed=3)
    epochs = []
    for epoch in range(2):
        s.set_epoch(epoch)
        mine_ = list(s)
        every = comm.comm.allgather(mine_)
        assert len({len(e) for e in every}) == 1 and len(mine_) == len(s)
        union = [i for e in every for i in e]
        if drop_last:
            assert len(union) == (n // comm.size) * comm.size and len(set(union)) == len(union)
        else:
            assert set(union) == set(data) and len(union) == -(-n // comm.size) * comm.size
        epochs.append(union)
    assert comm.size * len(s) < 2 or epochs[0] != epochs[1]

