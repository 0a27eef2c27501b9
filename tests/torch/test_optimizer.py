"""mpidist.torch.DistributedOptimizer: training equals one process on the whole batch, DDP
equals it, gradients stay in the flat buffer, bad input fails on every rank."""
import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch", reason="mpidist.torch needs PyTorch (the [torch] extra)")

import mpidist.torch as mt                                     # noqa: E402
from mpidist.comm import Communicator                          # noqa: E402
from mpidist.errors import MismatchError, RemoteError          # noqa: E402
from tests import gloo as gloo_groups                         # noqa: E402

PER_RANK = 3       # samples per rank: the global batch is PER_RANK * size


def make_model(seed=0, hidden=16, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 4)).to(dtype)


def batches(steps, size, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(PER_RANK * size, 8, generator=g),
             torch.randint(0, 4, (PER_RANK * size,), generator=g)) for _ in range(steps)]


def mine(x, rank):
    return x[PER_RANK * rank:PER_RANK * (rank + 1)]


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def train(opt, model, data, rank, steps=None):
    for x, y in data[:steps]:
        opt.zero_grad()
        loss_of(model, mine(x, rank), mine(y, rank)).backward()
        opt.step()


def close(a, b, rtol=1e-5):
    """Relative to the tensor's scale (1e-5 of its largest entry)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()) <= rtol * max(1e-3, float(b.abs().max()))


def assert_same_params(m1, m2, rtol=1e-5):
    bad = [n for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters())
           if not close(p, q, rtol)]
    assert not bad, f"parameters differ: {bad}"


OPTIMIZERS = {
    "sgd": (("sgd", dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3)),
    "adamw": (("adamw", dict(lr=1e-2, weight_decay=1e-2)),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2)),
    "lamb": (("lamb", dict(lr=1e-2, weight_decay=1e-2)), None),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_equals_one_process_on_the_whole_batch(comm, name):
    (opt_name, hyper), torch_ref = OPTIMIZERS[name]
    data = batches(5, comm.size)
    model = make_model()
    opt = mt.DistributedOptimizer(model, opt_name, comm=comm, bucket_mb=1e-3, **hyper)
    train(opt, model, data, comm.rank)
    # one process on the whole batch: the same optimizer over a one-rank communicator
    solo = Communicator(MPI.COMM_SELF)
    ref = make_model()
    ropt = mt.DistributedOptimizer(ref, opt_name, comm=solo, **hyper)
    for x, y in data:
        ropt.zero_grad()
        loss_of(ref, x, y).backward()
        ropt.step()
    assert_same_params(model, ref)
    if torch_ref is not None:         # and torch's own optimizer, where it has one
        tref = make_model()
        topt = torch_ref(tref.parameters())
        for x, y in data:
            topt.zero_grad()
            loss_of(tref, x, y).backward()
            topt.step()
        assert_same_params(model, tref)
    ropt.close()
    opt.close()
    solo.free()


def test_torch_optimizer_equals_one_process(comm):
    data = batches(5, comm.size)
    model = make_model()
    opt = mt.DistributedOptimizer(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                  comm=comm)
    train(opt, model, data, comm.rank)
    ref = make_model()
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for x, y in data:
        ropt.zero_grad()
        loss_of(ref, x, y).backward()
        ropt.step()
    assert_same_params(model, ref)
    opt.close()


@pytest.mark.parametrize("kind", ["sgd_fused", "adam"])
def test_torch_optimizer_updates_bucket_by_bucket_as_one_process(comm, kind):
    """With several buckets, step() updates each as it comes back (the wrapped optimizer's
    step over that bucket's parameters); the result is one process's, and a skipped step
    (Inf on one rank) updates nothing."""
    def make(ps):
        if kind == "adam":
            return torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3)
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True)
    data = batches(4, comm.size)
    model = make_model()
    inner = make(model.parameters())
    calls = []
    step = inner.step
    inner.step = lambda *a, **k: (calls.append(1), step(*a, **k))[1]
    opt = mt.DistributedOptimizer(model, inner, comm=comm, bucket_mb=1e-4)
    nb = len(opt.buckets.buckets)
    assert nb >= 3
    train(opt, model, data, comm.rank)
    assert len(calls) == 4 * nb
    ref = make_model()
    ropt = make(ref.parameters())
    for x, y in data:
        ropt.zero_grad()
        loss_of(ref, x, y).backward()
        ropt.step()
    assert_same_params(model, ref)
    before = opt.flat_params.copy()
    x, y = data[0]
    opt.zero_grad()
    loss = loss_of(model, mine(x, comm.rank), mine(y, comm.rank))
    (loss * (float("inf") if comm.rank == comm.size - 1 else 1.0)).backward()
    opt.step()
    assert opt.last_step["skipped"] and np.array_equal(opt.flat_params, before)
    opt.close()


def test_step_hooks_run_once_per_step_with_several_buckets(comm):
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    inner.register_step_post_hook(lambda *a: seen.append("inner"))
    opt = mt.DistributedOptimizer(model, inner, comm=comm, bucket_mb=1e-4)
    opt.register_step_post_hook(lambda *a: seen.append("outer"))
    train(opt, model, batches(2, comm.size), comm.rank)
    assert seen == ["inner", "outer"] * 2
    opt.close()


@pytest.fixture(scope="module")
def gloo():
    """torch.distributed over gloo on the same ranks (a port agreed from rank 0)."""
    import os
    import socket

    import torch.distributed as dist
    world = MPI.COMM_WORLD

    def init():
        port = None
        if world.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = world.bcast(port, root=0)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=world.rank, world_size=world.size,
                                timeout=gloo_groups.TIMEOUT)
    gloo_groups.agreed(init, lambda _: dist.destroy_process_group())
    yield dist
    dist.destroy_process_group()


def test_ddp_and_mpidist_equal_after_20_adamw_steps(comm, gloo):
    data = batches(20, comm.size)
    ddp = torch.nn.parallel.DistributedDataParallel(make_model())
    dopt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    train(dopt, ddp, data, comm.rank)
    model = make_model()
    opt = mt.DistributedOptimizer(model, "adamw", lr=1e-2, comm=comm, bucket_mb=1e-3)
    train(opt, model, data, comm.rank)
    assert_same_params(model, ddp.module)
    opt.close()


def inside(t, flat):
    lo = flat.ctypes.data
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= lo + flat.nbytes


def test_grads_stay_in_the_flat_buffer(comm):
    model = make_model()
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm)
    data = batches(4, comm.size)
    ptrs = [p.grad.data_ptr() for p in model.parameters()]
    assert all(inside(p.grad, opt.flat_grads) and inside(p, opt.flat_params)
               for p in model.parameters())
    for i, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=bool(i % 2))
        loss_of(model, mine(x, comm.rank), mine(y, comm.rank)).backward()
        assert [p.grad.data_ptr() for p in model.parameters()] == ptrs
        opt.step()
        assert [p.grad.data_ptr() for p in model.parameters()] == ptrs
    # the torch-style zero_grad of the model itself keeps the views too
    model.zero_grad(set_to_none=False)
    assert [p.grad.data_ptr() for p in model.parameters()] == ptrs
    assert not opt.flat_grads.any()
    opt.close()


def test_accumulation_equals_one_pass(comm):
    data = batches(3, comm.size)
    model, ref = make_model(), make_model()
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, momentum=0.9, comm=comm,
                                  backward_passes_per_step=3)
    ropt = mt.DistributedOptimizer(ref, "sgd", lr=0.1, momentum=0.9, comm=comm)
    for _ in range(2):
        opt.zero_grad()
        for x, y in data:           # three passes, each a third of the loss
            (loss_of(model, mine(x, comm.rank), mine(y, comm.rank)) / 3).backward()
        opt.step()
        ropt.zero_grad()
        x = torch.cat([mine(x, comm.rank) for x, _ in data])
        y = torch.cat([mine(y, comm.rank) for _, y in data])
        loss_of(ref, x, y).backward()
        ropt.step()
    assert_same_params(model, ref)
    opt.close()
    ropt.close()


def test_op_sum_and_broadcast_from_rank_0(comm):
    model, ref = make_model(seed=comm.rank), make_model(seed=0)
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.05, op="sum", comm=comm)
    assert_same_params(model, ref, rtol=0)           # rank 0's start everywhere
    x, y = batches(1, comm.size)[0]
    opt.zero_grad()
    loss_of(model, mine(x, comm.rank), mine(y, comm.rank)).backward()
    opt.step()
    # sum of the ranks' mean gradients: one process's gradient of size * mean loss
    rsolo = Communicator(MPI.COMM_SELF)
    ropt = mt.DistributedOptimizer(ref, "sgd", lr=0.05, comm=rsolo)
    ropt.zero_grad()
    (loss_of(ref, x, y) * comm.size).backward()
    ropt.step()
    assert_same_params(model, ref)
    opt.close()
    ropt.close()
    rsolo.free()


def test_frozen_parameters_left_out(comm):
    model = make_model(seed=comm.rank)
    model[0].weight.requires_grad_(False)
    opt = mt.DistributedOptimizer(model, "adamw", lr=1e-2, comm=comm)
    assert "0.weight" not in opt.layout.names and len(opt.layout) == 5
    frozen = model[0].weight.detach().clone()
    assert close(frozen, make_model(seed=0)[0].weight, 0)       # broadcast from rank 0
    train(opt, model, batches(2, comm.size), comm.rank)
    assert torch.equal(model[0].weight, frozen)
    opt.close()


def test_unfrozen_parameter_fails_everywhere_until_rebuilt(comm):
    """A parameter unfrozen after the DistributedOptimizer was built is in no flat buffer
    (nothing would reduce or update it): every rank raises and takes no step; built anew,
    training goes on as one process. A stale `.grad` on a frozen parameter is no error."""
    model, ref = make_model(), make_model()
    for m in (model, ref):
        m[0].weight.requires_grad_(False)
    model[0].weight.grad = torch.ones_like(model[0].weight)      # left from earlier training
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def step(o, m, x, y):
        o.zero_grad()
        loss_of(m, x, y).backward()
        o.step()
    (x, y), (x2, y2), (x3, y3) = batches(3, comm.size)
    step(opt, model, mine(x, comm.rank), mine(y, comm.rank))
    step(ropt, ref, x, y)
    before = [p.detach().clone() for p in model.parameters()]
    for m in (model, ref):
        m[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="'0.weight' was frozen"):
        step(opt, model, mine(x2, comm.rank), mine(y2, comm.rank))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.close()
    again = mt.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    comm=comm)           # now over every parameter
    step(again, model, mine(x3, comm.rank), mine(y3, comm.rank))
    step(ropt, ref, x3, y3)
    assert_same_params(model, ref)
    again.close()


def test_half_parameters_keep_float32_masters(comm):
    model = make_model(dtype=torch.bfloat16)
    opt = mt.DistributedOptimizer(model, "adamw", lr=1e-2, comm=comm)
    data = batches(3, comm.size)
    for x, y in data:
        opt.zero_grad()
        loss_of(model, mine(x, comm.rank).bfloat16(), mine(y, comm.rank)).backward()
        opt.step()
    master = opt.optimizer.state_buffers()["master"]
    assert master.dtype == np.float32 and opt.optimizer.step_count == 3
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(flat, torch.from_numpy(master).bfloat16())
    every = comm.comm.allgather(master.tobytes())
    assert all(b == every[0] for b in every)
    opt.close()


def test_nonfinite_gradient_on_one_rank_skips_everywhere(comm):
    model = make_model()
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm)
    before = opt.flat_params.copy()
    x, y = batches(1, comm.size)[0]
    opt.zero_grad()
    loss = loss_of(model, mine(x, comm.rank), mine(y, comm.rank))
    (loss * (float("nan") if comm.rank == comm.size - 1 else 1.0)).backward()
    opt.step()
    assert opt.last_step["skipped"] and np.array_equal(opt.flat_params, before)
    opt.close()


@pytest.mark.parametrize("bucket_mb", [4.0, 1e-4])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_infinite_element_skips_everywhere_then_training_goes_on(comm, where, bucket_mb):
    """Wherever the Inf lies (in the chunk a rank sums itself or in another's), on one rank,
    the step is skipped on every rank, and the next step is not."""
    model = make_model()
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm, bucket_mb=bucket_mb)
    n = opt.layout.numel
    k = {"first": 0, "middle": n // 2, "last": n - 1}[where]
    seg = next(s for s in opt.layout if s.offset <= k < s.stop)
    param = dict(model.named_parameters())[seg.name]

    def poison(g):
        g = g.clone()
        g.view(-1)[k - seg.offset] = float("inf")
        return g
    x, y = batches(1, comm.size)[0]
    before = opt.flat_params.copy()
    hook = param.register_hook(poison) if comm.rank == comm.size - 1 else None
    for skipped in (True, False):
        opt.zero_grad()
        loss_of(model, mine(x, comm.rank), mine(y, comm.rank)).backward()
        opt.step()
        assert opt.last_step["skipped"] == skipped
        assert np.array_equal(opt.flat_params, before) == skipped
        if hook is not None:
            hook.remove()
            hook = None
    opt.close()


def test_compression_keeps_ranks_identical(comm):
    model = make_model()
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm, compression="fp16")
    train(opt, model, batches(3, comm.size), comm.rank)
    every = comm.comm.allgather(opt.flat_params.tobytes())
    assert all(b == every[0] for b in every)
    assert opt.flat_params.any()
    opt.close()


@pytest.mark.parametrize("factors", ["float32", "float16"])
def test_compressed_gradients_go_as_one_bucket(comm, factors):
    """A compressor reduces in the calling thread, so the whole buffer is one bucket
    whatever bucket_mb says; PowerSGD (its sum in place, its factors in either dtype, after
    a warm-up step) keeps the ranks identical."""
    model = make_model()
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm, bucket_mb=1e-4,
                                  compression="powersgd", compression_options={
                                      "rank": 2, "factors": factors, "warmup_steps": 1})
    plain = mt.DistributedOptimizer(make_model(), "sgd", lr=0.1, comm=comm, bucket_mb=1e-4)
    assert len(opt.buckets.buckets) == 1 < len(plain.buckets.buckets)
    before = opt.flat_params.copy()
    train(opt, model, batches(3, comm.size), comm.rank)
    every = comm.comm.allgather(opt.flat_params.tobytes())
    assert all(b == every[0] for b in every)
    assert not np.array_equal(opt.flat_params, before)
    opt.close()
    plain.close()


def test_compression_warmup_steps_run_uncompressed(comm):
    """compression_options={"warmup_steps": N}: the first N steps are the exact sum."""
    data = batches(3, comm.size)
    model, plain = make_model(), make_model()
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm, compression="sign",
                                  compression_options={"warmup_steps": 3})
    ref = mt.DistributedOptimizer(plain, "sgd", lr=0.1, comm=comm)
    train(opt, model, data, comm.rank)
    train(ref, plain, data, comm.rank)
    assert_same_params(model, plain, rtol=1e-6)
    opt.close()
    ref.close()


# ---------------------------------------------------------------- bad input, every rank
def test_models_differing_between_ranks_fail_everywhere(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    model = make_model(hidden=16 + (comm.rank == comm.size - 1))
    with pytest.raises(MismatchError, match="differs between ranks"):
        mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm)
    named = list(make_model().named_parameters())
    if comm.rank == comm.size - 1:
        named = named[::-1]
    with pytest.raises(MismatchError, match="same order"):
        mt.DistributedOptimizer(named, "sgd", lr=0.1, comm=comm)


def test_parameter_passed_twice_fails_everywhere(comm):
    model = make_model()
    ps = list(model.parameters())
    if comm.rank == 0:
        ps.append(ps[0])
    with pytest.raises((ValueError, RemoteError), match="same tensor|failed on rank"):
        mt.DistributedOptimizer(ps, "sgd", lr=0.1, comm=comm)


def test_optimizer_over_other_tensors_fails_everywhere(comm):
    model, other = make_model(), make_model()
    with pytest.raises(ValueError, match="not one of the model's parameters"):
        mt.DistributedOptimizer(model, torch.optim.SGD(other.parameters(), lr=0.1), comm=comm)


def test_tensors_on_two_devices_fail_everywhere(comm):
    # a meta tensor stands in for a CUDA one: one bucket can not hold two devices
    model = make_model()
    model[4].bias = torch.nn.Parameter(torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm)


def test_more_backward_passes_than_declared_fail_everywhere(comm):
    model = make_model()
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm)
    x, y = batches(1, comm.size)[0]
    opt.zero_grad()
    for _ in range(2 if comm.rank == 0 else 1):
        loss_of(model, mine(x, comm.rank), mine(y, comm.rank)).backward()
    with pytest.raises((RuntimeError, RemoteError), match="backward_passes_per_step|rank"):
        opt.step()
    opt.close()


# ---------------------------------------------------------------- ZeRO
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("name,algorithm", [("adamw", "auto"), ("lamb", "ring")])
def test_zero_equals_data_parallel(comm, zero, name, algorithm):
    # "auto": gradients and parameters in shared windows; "ring": the collectives
    (opt_name, hyper), _ = OPTIMIZERS[name]
    data = batches(4, comm.size)
    model, ref = make_model(), make_model()
    opt = mt.DistributedOptimizer(model, opt_name, comm=comm, zero=zero, bucket_mb=1e-3,
                                  algorithm=algorithm, **hyper)
    ropt = mt.DistributedOptimizer(ref, opt_name, comm=comm, **hyper)
    a, b = opt.shard
    assert opt.optimizer.count == b - a <= -(-opt.layout.numel // comm.size)
    train(opt, model, data, comm.rank)
    train(ropt, ref, data, comm.rank)
    assert_same_params(model, ref)
    every = comm.comm.allgather(opt.flat_params.tobytes())
    assert all(e == every[0] for e in every)
    opt.close()
    ropt.close()


def test_zero_3_and_torch_optimizers_refused_everywhere(comm):
    model = make_model()
    with pytest.raises(ValueError, match="stage 3"):
        mt.DistributedOptimizer(model, "adamw", comm=comm, zero=3)
    with pytest.raises(TypeError, match="optimizer name"):
        mt.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), comm=comm,
                                zero=1)
