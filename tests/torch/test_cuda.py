"""CUDA models and mpidist.torch: a model on CUDA trains as one process on the whole batch
does (flat buffers and the update on the device, MPI given device buffers or staged through
host memory), with torch.amp.GradScaler, compression and state_dict; broadcasts of CUDA
tensors are ordered after torch's current stream; collectives take CUDA tensors in place.
A model on another device is refused on every rank with a message naming what works."""
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="mpidist.torch needs PyTorch (the [torch] extra)")

import mpidist.torch as mt                                     # noqa: E402
from mpidist.collectives import allreduce                      # noqa: E402
from tests.torch.test_optimizer import (OPTIMIZERS, assert_same_params, batches,  # noqa: E402
                                        loss_of, make_model, mine)


def test_a_model_off_the_cpu_and_cuda_is_refused_everywhere(comm):
    # a meta model stands in for a device mpidist does not train on
    model = make_model().to("meta")
    with pytest.raises(ValueError, match="trains CPU and CUDA tensors"):
        mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm)


def solo_on_cuda(data, torch_opt, *, scaler=None, steps=None):
    """One process on the whole batch, on the GPU, with torch's optimizer."""
    ref = make_model().cuda()
    ropt = torch_opt(ref.parameters())
    for x, y in data[:steps]:
        ropt.zero_grad()
        loss = loss_of(ref, x.cuda(), y.cuda())
        if scaler is None:
            loss.backward()
            ropt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(ropt)
            scaler.update()
    return ref


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sgd", "adamw", "torch-adamw"])
def test_cuda_model_equals_one_process_on_the_whole_batch(comm, kind):
    (name, hyper), torch_opt = OPTIMIZERS[kind.replace("torch-", "")]
    data = batches(5, comm.size)
    model = make_model(seed=comm.rank).cuda()      # rank 0's parameters win (broadcast)
    opt = mt.DistributedOptimizer(model, torch_opt(model.parameters()) if "torch" in kind
                                  else name, comm=comm, bucket_mb=1e-3,
                                  **({} if "torch" in kind else hyper))
    assert opt.flat_params.device.id == model[0].weight.device.index
    for x, y in data:
        opt.zero_grad()
        loss_of(model, mine(x, comm.rank).cuda(), mine(y, comm.rank).cuda()).backward()
        opt.step()
        assert model[0].weight.grad.device.type == "cuda"
    assert_same_params(model, solo_on_cuda(data, torch_opt))
    opt.close()


@pytest.mark.gpu
def test_cuda_grad_is_the_average_after_synchronize(comm):
    x, y = batches(1, comm.size)[0]
    model = make_model().cuda()
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm, bucket_mb=1e-3)
    loss_of(model, mine(x, comm.rank).cuda(), mine(y, comm.rank).cuda()).backward()
    assert opt.synchronize()
    ref = make_model().cuda()
    loss_of(ref, x.cuda(), y.cuda()).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    opt.step()
    opt.close()


@pytest.mark.gpu
def test_grad_scaler_on_cuda_equals_one_process_and_skips_everywhere(comm):
    data = batches(4, comm.size)
    sgd = OPTIMIZERS["sgd"][1]
    model = make_model().cuda()
    opt = mt.DistributedOptimizer(model, sgd(model.parameters()), comm=comm, bucket_mb=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    for x, y in data:
        opt.zero_grad()
        scaler.scale(loss_of(model, mine(x, comm.rank).cuda(),
                             mine(y, comm.rank).cuda())).backward()
        opt.synchronize()                 # averaged: unscale_ and clipping see the mean
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
        scaler.step(opt)
        scaler.update()
    ref = solo_on_cuda(data, sgd, scaler=torch.amp.GradScaler("cuda", init_scale=1024.0))
    assert_same_params(model, ref)
    # an Inf on the last rank only: every rank skips the step and halves its scale
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data[0]
    opt.zero_grad()
    loss = loss_of(model, mine(x, comm.rank).cuda(), mine(y, comm.rank).cuda())
    if comm.rank == comm.size - 1:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    opt.synchronize()
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == scale / 2
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.close()


@pytest.mark.gpu
def test_cuda_compression_keeps_ranks_identical(comm):
    data = batches(4, comm.size)
    model = make_model().cuda()
    opt = mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm, compression="powersgd",
                                  compression_options={"rank": 2})
    for x, y in data:
        opt.zero_grad()
        loss_of(model, mine(x, comm.rank).cuda(), mine(y, comm.rank).cuda()).backward()
        opt.step()
    flat = opt.flat_params.get()
    every = comm.comm.allgather(flat)
    assert np.isfinite(flat).all() and all(np.array_equal(flat, f) for f in every)
    opt.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["adamw", "torch-adamw"])
def test_cuda_state_dict_round_trips_through_torch_save(comm, kind):
    (name, hyper), torch_opt = OPTIMIZERS["adamw"]
    data = batches(4, comm.size)

    def build():
        model = make_model().cuda()
        return model, mt.DistributedOptimizer(
            model, torch_opt(model.parameters()) if "torch" in kind else name, comm=comm,
            **({} if "torch" in kind else hyper))

    def step(model, opt, x, y):
        opt.zero_grad()
        loss_of(model, mine(x, comm.rank).cuda(), mine(y, comm.rank).cuda()).backward()
        opt.step()
    model, opt = build()
    for x, y in data[:3]:
        step(model, opt, x, y)
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=False)
    model2, opt2 = build()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    step(model, opt, *data[3])
    step(model2, opt2, *data[3])
    assert_same_params(model2, model)
    opt.close()
    opt2.close()


@pytest.mark.gpu
def test_cuda_zero_refused_everywhere(comm):
    model = make_model().cuda()
    with pytest.raises(ValueError, match="ZeRO for a model on CUDA"):
        mt.DistributedOptimizer(model, "adamw", lr=1e-3, comm=comm, zero=1)


@pytest.mark.gpu
def test_broadcast_of_cuda_parameters_follows_torch_stream(comm):
    model = make_model(seed=comm.rank).cuda()
    with torch.no_grad():                  # queued on torch's stream, before the broadcast
        for p in model.parameters():
            p.mul_(2.0)
    mt.broadcast_parameters(model, root_rank=0, comm=comm)
    ref = make_model(seed=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.cpu(), 2.0 * q.detach())


@pytest.mark.gpu
def test_allreduce_of_a_cuda_tensor_lands_in_place(comm):
    t = torch.arange(10, dtype=torch.float32, device="cuda")
    t.mul_(comm.rank + 1)                  # queued work the collective must wait for
    ptr = t.data_ptr()
    out = allreduce(t, comm=comm)
    expect = np.arange(10, dtype=np.float32) * sum(range(1, comm.size + 1))
    torch.cuda.synchronize()
    assert out.data_ptr() == ptr and np.array_equal(out.cpu().numpy(), expect)
