"""CUDA tensors and mpidist.torch: a model on another device is refused on every rank with
a message naming what works; broadcasts of CUDA tensors go through host copies ordered
after torch's current stream; collectives take CUDA tensors in place."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="mpidist.torch needs PyTorch (the [torch] extra)")

import mpidist.torch as mt                                     # noqa: E402
from mpidist.collectives import allreduce                      # noqa: E402
from tests.torch.test_optimizer import make_model              # noqa: E402


def test_a_model_off_the_cpu_is_refused_everywhere(comm):
    # a meta model stands in for a CUDA one where there is no GPU
    model = make_model().to("meta")
    with pytest.raises(ValueError, match="trains CPU tensors"):
        mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm)


@pytest.mark.gpu
def test_cuda_model_refused_and_broadcast(comm):
    model = make_model(seed=comm.rank).cuda()
    with pytest.raises(ValueError, match="trains CPU tensors"):
        mt.DistributedOptimizer(model, "sgd", lr=0.1, comm=comm)
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
