"""CUDA tensors over "mpidist": each collective is ordered after torch's current stream and
gives gloo's result on the same values on the host. One GPU per node is enough: every rank
uses device local_rank % device count. Skipped without CuPy and a CUDA GPU."""
import pytest

torch = pytest.importorskip("torch", reason="needs torch (scripts/setup_env.sh installs it)")
import torch.distributed as dist  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::FutureWarning")]


def _device():
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())


def _data(n, dtype, salt=0):
    r = dist.get_rank()
    return ((torch.arange(n) * 7 + r * 3 + salt) % 7 - 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16])
def test_all_reduce_after_the_current_stream(groups, dtype):
    """The input is written by a kernel queued on a side stream made current: the
    allreduce must see it (ordered after that stream), and its result is gloo's."""
    dev, gloo = _device(), groups[1]
    side = torch.cuda.Stream(dev)
    t = torch.zeros(100_003, dtype=dtype, device=dev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)                  # the copy below lands late
        t.copy_(_data(100_003, dtype).to(dev, non_blocking=True))
        work = dist.all_reduce(t, async_op=True)
    work.wait()
    ref = _data(100_003, dtype)
    dist.all_reduce(ref, group=gloo)
    assert torch.equal(t.cpu(), ref)


def test_broadcast_allgather_and_reduce_scatter(groups):
    dev, gloo, size = _device(), groups[1], dist.get_world_size()
    t = _data(37, torch.float32).to(dev)
    dist.broadcast(t, src=size - 1)
    ref = _data(37, torch.float32)
    dist.broadcast(ref, src=size - 1, group=gloo)
    assert torch.equal(t.cpu(), ref)
    out = torch.empty(9 * size, device=dev)
    dist.all_gather_into_tensor(out, _data(9, torch.float32).to(dev))
    ref = torch.empty(9 * size)
    dist.all_gather_into_tensor(ref, _data(9, torch.float32), group=gloo)
    assert torch.equal(out.cpu(), ref)
    shard = torch.empty(5, device=dev)
    dist.reduce_scatter_tensor(shard, _data(5 * size, torch.float32).to(dev))
    full = _data(5 * size, torch.float32)
    dist.all_reduce(full, group=gloo)
    assert torch.equal(shard.cpu(), full[5 * dist.get_rank():5 * dist.get_rank() + 5])


def test_ddp_on_cuda_matches_gloo_on_the_host(groups):
    """DDP of a CUDA model over "mpidist" and of its host copy over gloo: the same
    parameters after 5 SGD steps."""
    dev, gloo = _device(), groups[1]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    models = [torch.nn.parallel.DistributedDataParallel(net.to(dev).double()),
              torch.nn.parallel.DistributedDataParallel(_copy(net).double(),
                                                        process_group=gloo)]
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(8, 16, generator=gen).double(), torch.randn(8, 4, generator=gen).double()
    for model, where in zip(models, (dev, "cpu")):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(where)), y.to(where)).backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-12, atol=1e-12)


def _copy(net):
    import copy
    return copy.deepcopy(net).cpu()
