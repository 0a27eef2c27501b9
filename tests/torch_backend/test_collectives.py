"""Each collective over "mpidist" gives gloo's result (or, where gloo lacks the collective,
the result written out), for float32, float64, int64 and bfloat16. Values are small
integers, so every sum is exact in every dtype and the results must match bit for bit."""
import pytest

torch = pytest.importorskip("torch", reason="needs torch (scripts/setup_env.sh installs it)")
import torch.distributed as dist  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")     # torch renaming collectives
DTYPES = [torch.float32, torch.float64, torch.int64, torch.bfloat16]


def _data(n, dtype, salt=0):
    """Small integers that differ by rank (|x| <= 3, so products of 4 stay exact)."""
    r = dist.get_rank()
    return ((torch.arange(n) * 7 + r * 3 + salt) % 7 - 3).to(dtype)


def _both(fn):
    """fn(group) on the mpidist group and on the gloo group: (ours, gloo's)."""
    return fn(None), fn(_gloo)


@pytest.fixture(autouse=True)
def _gloo_group(groups):
    global _gloo
    _gloo = groups[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX"])
def test_all_reduce_in_place(dtype, op):
    def run(group):
        t = _data(37, dtype)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
        return t
    ours, ref = _both(run)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_all_reduce_avg_is_sum_over_size(dtype):
    """gloo has no AVG: the reference is its SUM divided by the group size."""
    t = _data(37, dtype)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    ref = _data(37, torch.float64)
    dist.all_reduce(ref, group=_gloo)
    assert torch.equal(t, (ref / dist.get_world_size()).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_reduce_sizes_in_turn(dtype):
    """One node's window path: sizes that grow it, alternate its two regions, span several
    blocks and split unevenly; in place, AVG, and reduce (into scratch off the root)."""
    for n in (5, 300_001, 37, 1, 700_003, 8):
        ours, ref = _both(lambda group: _reduced(_data(n, dtype), group))
        assert torch.equal(ours, ref), n
    t = _data(300_001, dtype)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.equal(t, _reduced(_data(300_001, dtype), _gloo) / dist.get_world_size())
    root = dist.get_world_size() - 1
    t, ref = _data(70_001, dtype), _reduced(_data(70_001, dtype), _gloo)
    dist.reduce(t, root)
    assert torch.equal(t, ref if dist.get_rank() == root else _data(70_001, dtype))


def _reduced(t, group):
    dist.all_reduce(t, group=group)
    return t


def test_all_reduce_premul_sum():
    """PREMUL_SUM (what DDP and FSDP may use to pre-divide): factor x the sum."""
    t = _data(37, torch.float32)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    ref = _data(37, torch.float32)
    dist.all_reduce(ref, group=_gloo)
    assert torch.equal(t, ref * 0.5)


def test_all_reduce_async_work_and_future():
    """async_op=True: a Work whose wait() returns True and whose future holds the tensor."""
    t = _data(1000, torch.float32)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    assert work.wait() is True and work.is_completed()
    ref = _data(1000, torch.float32)
    dist.all_reduce(ref, group=_gloo)
    assert torch.equal(fut.wait()[0], ref) and torch.equal(t, ref)


def test_all_reduce_async_before_a_message_it_waits_for():
    """Rank 1 calls an allreduce only after a message that rank 0 sends after starting its
    own asynchronously: rank 0's call must not keep its thread (a window allreduce begun on
    the calling thread hands the rest to the worker)."""
    size, rank = dist.get_world_size(), dist.get_rank()
    if size == 1:
        pytest.skip("needs two ranks")
    n = 50_000
    ref = _reduced(_data(n, torch.float32), None)      # the window has room for it now
    t, box = _data(n, torch.float32), torch.zeros(1)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        dist.send(torch.ones(1), 1)
        work.wait()
    else:
        if rank == 1:
            dist.recv(box, 0)
        dist.all_reduce(t)
    assert torch.equal(t, ref) and (rank != 1 or box.item() == 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_coalesced(dtype):
    def run(group):
        ts = [_data(n, dtype, salt=n) for n in (5, 17, 1)]
        dist.all_reduce_coalesced(ts, group=group)
        return torch.cat(ts)
    ours, ref = _both(run)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_in_place(dtype):
    root = dist.get_world_size() - 1

    def run(group):
        t = _data(33, dtype)
        dist.broadcast(t, root, group=group)
        return t
    ours, ref = _both(run)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_to_root(dtype):
    root = dist.get_world_size() // 2
    t = _data(21, dtype)
    dist.reduce(t, root)
    ref = _data(21, dtype)
    dist.all_reduce(ref, group=_gloo)
    if dist.get_rank() == root:
        assert torch.equal(t, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_lists_and_into_tensor(dtype):
    size = dist.get_world_size()

    def run(group):
        outs = [torch.empty(9, dtype=dtype) for _ in range(size)]
        dist.all_gather(outs, _data(9, dtype), group=group)
        flat = torch.empty(9 * size, dtype=dtype)
        dist.all_gather_into_tensor(flat, _data(9, dtype, salt=1), group=group)
        return torch.cat(outs + [flat])
    ours, ref = _both(run)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("n", [1, 3, 8])           # odd byte counts go through MPI_Allgather
def test_all_gather_of_bytes(n):
    size = dist.get_world_size()

    def run(group):
        flat = torch.empty(n * size, dtype=torch.uint8)
        dist.all_gather_into_tensor(flat, torch.full((n,), dist.get_rank() + 1,
                                                     dtype=torch.uint8), group=group)
        return flat
    ours, ref = _both(run)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_into_tensor_coalesced(dtype):
    """The coalescing manager's fast path (all_gather_into_tensor_coalesced), as FSDP uses."""
    size = dist.get_world_size()
    outs = [torch.empty(n * size, dtype=dtype) for n in (4, 7)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, n in zip(outs, (4, 7)):
            dist.all_gather_into_tensor(o, _data(n, dtype, salt=n))
    cm.wait()
    for o, n in zip(outs, (4, 7)):
        ref = torch.empty(n * size, dtype=dtype)
        dist.all_gather_into_tensor(ref, _data(n, dtype, salt=n), group=_gloo)
        assert torch.equal(o, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["SUM", "MAX"])
def test_reduce_scatter_lists_and_tensor(dtype, op):
    size, rop = dist.get_world_size(), getattr(dist.ReduceOp, op)

    def run(group):
        out1 = torch.empty(6, dtype=dtype)
        dist.reduce_scatter(out1, [_data(6, dtype, salt=j) for j in range(size)], op=rop,
                            group=group)
        out2 = torch.empty(5, dtype=dtype)
        inp = _data(5 * size, dtype, salt=2)
        keep = inp.clone()
        dist.reduce_scatter_tensor(out2, inp, op=rop, group=group)
        assert torch.equal(inp, keep), "the input must be left unchanged"
        return torch.cat([out1, out2])
    if dtype == torch.bfloat16 or size == 1:
        # gloo's reduce-scatter does not take bfloat16 (nor run at one rank): the written-out
        # reduction of all inputs, my chunk of it
        full = _data(5 * size, torch.float64, salt=2)
        dist.all_reduce(full, op=rop, group=_gloo)
        ref = full[5 * dist.get_rank():5 * dist.get_rank() + 5].to(dtype)
        assert torch.equal(run(None)[6:], ref)
        return
    ours, ref = _both(run)
    assert torch.equal(ours, ref)


def test_reduce_scatter_tensor_coalesced():
    size, rank = dist.get_world_size(), dist.get_rank()
    outs = [torch.empty(n) for n in (3, 2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, n in zip(outs, (3, 2)):
            dist.reduce_scatter_tensor(o, _data(n * size, torch.float32, salt=n))
    cm.wait()
    for o, n in zip(outs, (3, 2)):
        full = _data(n * size, torch.float32, salt=n)
        dist.all_reduce(full, group=_gloo)
        assert torch.equal(o, full[n * rank:n * rank + n])


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all_single_even_and_uneven(dtype):
    size, rank = dist.get_world_size(), dist.get_rank()

    def run(group):
        out = torch.empty(3 * size, 2, dtype=dtype)
        dist.all_to_all_single(out, _data(6 * size, dtype).reshape(3 * size, 2), group=group)
        # uneven: rank r sends j + 1 rows to rank j and so receives r + 1 rows from each
        send = [j + 1 for j in range(size)]
        out2 = torch.empty((rank + 1) * size, dtype=dtype)
        dist.all_to_all_single(out2, _data(sum(send), dtype, salt=5), output_split_sizes=
                               [rank + 1] * size, input_split_sizes=send, group=group)
        return torch.cat([out.reshape(-1), out2])
    ours, ref = _both(run)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all_lists(dtype):
    """gloo has no list all_to_all: rank r receives from rank j the tensor j made for r."""
    size, rank = dist.get_world_size(), dist.get_rank()
    ins = [torch.full((j + 2,), 10 * rank + j).to(dtype) for j in range(size)]
    outs = [torch.empty(rank + 2, dtype=dtype) for _ in range(size)]
    dist.all_to_all(outs, ins)
    for j, o in enumerate(outs):
        assert torch.equal(o, torch.full((rank + 2,), 10 * j + rank).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_and_scatter(dtype):
    size, rank = dist.get_world_size(), dist.get_rank()
    root = size - 1

    def run(group):
        outs = [torch.empty(4, dtype=dtype) for _ in range(size)] if rank == root else None
        dist.gather(_data(4, dtype), outs, dst=root, group=group)
        got = torch.empty(5, dtype=dtype)
        ins = [_data(5, dtype, salt=j) for j in range(size)] if rank == root else None
        dist.scatter(got, ins, src=root, group=group)
        return torch.cat((outs or []) + [got])
    ours, ref = _both(run)
    assert torch.equal(ours, ref)


def test_send_recv_ring_and_batched_exchange():
    """A ring of sends, then every pair exchanging with isend/irecv posted send-first."""
    size, rank = dist.get_world_size(), dist.get_rank()
    if size == 1:
        pytest.skip("point-to-point needs two ranks")
    t = torch.full((1000,), float(rank))
    got = torch.empty(1000)
    ops = [dist.P2POp(dist.isend, t, (rank + 1) % size),
           dist.P2POp(dist.irecv, got, (rank - 1) % size)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(got, torch.full((1000,), float((rank - 1) % size)))
    if rank % 2 == 0 and rank + 1 < size:
        dist.send(t, rank + 1, tag=7)
    elif rank % 2 == 1:
        dist.recv(got, rank - 1, tag=7)
        assert torch.equal(got, torch.full((1000,), float(rank - 1)))


def test_barrier_and_object_collectives():
    """barrier, and the object collectives torch builds on broadcast and all_gather."""
    dist.barrier()
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, {"rank": dist.get_rank()})
    assert [o["rank"] for o in objs] == list(range(dist.get_world_size()))
    box = [dist.get_rank() * 10]
    dist.broadcast_object_list(box, src=0)
    assert box == [0]
