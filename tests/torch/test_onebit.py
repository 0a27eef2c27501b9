"""1-bit Adam and 1-bit LAMB through mpidist.torch: the NumPy engine's result on the same
gradients, through the warm-up and the compressed stage; ZeRO-1 equals data parallel."""
import pytest

torch = pytest.importorskip("torch", reason="mpidist.torch needs PyTorch (the [torch] extra)")

import mpidist.torch as mt                                               # noqa: E402
from mpidist.engine.distributed import DistributedOptimizer as FlatDist  # noqa: E402
from mpidist.optim import build_optimizer                                # noqa: E402
from tests.torch.test_optimizer import (assert_same_params, batches,  # noqa: E402
                                        loss_of, make_model, mine)

STEPS, FREEZE = 6, 3       # three warm-up steps, then three compressed ones
HYPER = {"onebit_adam": dict(lr=1e-2, weight_decay=1e-2, freeze_step=FREEZE),
         "onebit_lamb": dict(lr=1e-2, weight_decay=1e-2, freeze_step=FREEZE)}


@pytest.mark.parametrize("name", sorted(HYPER))
def test_onebit_equals_the_numpy_engine(comm, name):
    data = batches(STEPS, comm.size)
    model = make_model()
    opt = mt.DistributedOptimizer(model, name, comm=comm, bucket_mb=1e-3, **HYPER[name])
    for x, y in data:
        opt.zero_grad()
        loss_of(model, mine(x, comm.rank), mine(y, comm.rank)).backward()
        opt.step()
    assert opt.optimizer.frozen and opt.optimizer.step_count == STEPS
    # the NumPy engine on the gradients of the same model at its own parameters
    ref = make_model()
    arrays = [p.detach().numpy().copy() for p in ref.parameters()]
    names = [n for n, _ in ref.named_parameters()]
    engine = FlatDist.for_arrays(
        arrays, lambda layout: build_optimizer(name, layout, **HYPER[name]), names=names,
        comm=comm)
    for x, y in data:
        with torch.no_grad():
            for p, a in zip(ref.parameters(), arrays):
                p.copy_(torch.from_numpy(a))
        ref.zero_grad()
        loss_of(ref, mine(x, comm.rank), mine(y, comm.rank)).backward()
        engine.step([p.grad.numpy().copy() for p in ref.parameters()])
    with torch.no_grad():
        for p, a in zip(ref.parameters(), arrays):
            p.copy_(torch.from_numpy(a))
    assert_same_params(model, ref)
    every = comm.comm.allgather(opt.flat_params.tobytes())
    assert all(e == every[0] for e in every)
    opt.close()


@pytest.mark.parametrize("name", sorted(HYPER))
def test_onebit_zero1_equals_data_parallel(comm, name):
    data = batches(STEPS, comm.size)
    model, ref = make_model(), make_model()
    opt = mt.DistributedOptimizer(model, name, comm=comm, zero=1, **HYPER[name])
    ropt = mt.DistributedOptimizer(ref, name, comm=comm, **HYPER[name])
    for o, m in ((opt, model), (ropt, ref)):
        for x, y in data:
            o.zero_grad()
            loss_of(m, mine(x, comm.rank), mine(y, comm.rank)).backward()
            o.step()
    assert_same_params(model, ref)
    opt.close()
    ropt.close()


def test_onebit_refusals_name_what_works(comm):
    model = make_model()
    with pytest.raises(ValueError, match="zero=0.*zero=1"):
        mt.DistributedOptimizer(model, "onebit_adam", comm=comm, zero=2)
    with pytest.raises(ValueError, match="compresses its momentum itself"):
        mt.DistributedOptimizer(model, "onebit_lamb", comm=comm, compression="fp16")


def test_onebit_checkpoint_resumes_the_compressed_stage(comm, shared_dir):
    import os

    from mpidist.torch.checkpoint import load_checkpoint, save_checkpoint
    name, data = "onebit_lamb", batches(STEPS, comm.size)

    def run(opt, model, part):
        for x, y in part:
            opt.zero_grad()
            loss_of(model, mine(x, comm.rank), mine(y, comm.rank)).backward()
            opt.step()
    model = make_model()
    opt = mt.DistributedOptimizer(model, name, comm=comm, **HYPER[name])
    run(opt, model, data[:FREEZE + 1])          # one compressed step: residuals are set
    path = os.path.join(shared_dir, "onebit.h5")
    save_checkpoint(path, opt, FREEZE + 1, model=model)
    run(opt, model, data[FREEZE + 1:])
    fresh = make_model(seed=5)
    again = mt.DistributedOptimizer(fresh, name, comm=comm, **HYPER[name])
    assert load_checkpoint(path, again, model=fresh) == FREEZE + 1
    run(again, fresh, data[FREEZE + 1:])
    assert_same_params(fresh, model, rtol=1e-6)
    opt.close()
    again.close()
