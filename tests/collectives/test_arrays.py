"""Any array in the collectives: torch tensors in place (same data pointer), JAX arrays out
of place, DLPack and buffer-protocol objects; results equal NumPy's."""
import array

import numpy as np
import pytest

from mpidist.collectives import allgather, allreduce, allreduce_async, reduce_scatter


def data(rank, n=11, dtype=np.float32):
    return (np.arange(n) * (rank + 1) + 0.5).astype(dtype)


def expected(comm, n=11, dtype=np.float32, op="sum"):
    x = data(comm.rank, n, dtype)
    return allreduce(x, op=op, comm=comm)


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_torch_tensor_reduced_in_place(comm, op):
    torch = pytest.importorskip("torch", reason="torch is optional")
    t = torch.from_numpy(data(comm.rank)).clone()
    ptr = t.data_ptr()
    res = allreduce(t, op=op, comm=comm)
    assert res is t and t.data_ptr() == ptr
    np.testing.assert_array_equal(t.numpy(), expected(comm, op=op))
    h = allreduce_async(t.clone().copy_(torch.from_numpy(data(comm.rank))), op=op, comm=comm)
    np.testing.assert_array_equal(h.wait().numpy(), expected(comm, op=op))


def test_torch_bfloat16_and_lists(comm):
    torch = pytest.importorskip("torch", reason="torch is optional")
    b = torch.full((6,), float(comm.rank + 1), dtype=torch.bfloat16)
    ptr = b.data_ptr()
    allreduce(b, comm=comm)
    assert b.data_ptr() == ptr and b.dtype == torch.bfloat16
    assert b.float().tolist() == [comm.size * (comm.size + 1) / 2] * 6
    ts = [torch.from_numpy(data(comm.rank, n)).clone() for n in (3, 7, 1)]
    ptrs = [t.data_ptr() for t in ts]
    out = allreduce_async(ts, comm=comm, bucket_bytes=16).wait()
    assert all(o is t for o, t in zip(out, ts)) and [t.data_ptr() for t in ts] == ptrs
    for t, n in zip(ts, (3, 7, 1)):
        np.testing.assert_array_equal(t.numpy(), expected(comm, n))


def test_torch_reduce_scatter_and_allgather(comm):
    torch = pytest.importorskip("torch", reason="torch is optional")
    n = 13
    shard = reduce_scatter(torch.from_numpy(data(comm.rank, n)), comm=comm)
    want = reduce_scatter(data(comm.rank, n), comm=comm)
    assert isinstance(shard, torch.Tensor)
    np.testing.assert_array_equal(shard.numpy(), want)
    full = torch.empty(n)
    ptr = full.data_ptr()
    res = allgather(shard, comm=comm, out=full)
    assert res is full and full.data_ptr() == ptr
    np.testing.assert_array_equal(full.numpy(), allgather(want, comm=comm))


def test_torch_compressed_allreduce(comm):
    torch = pytest.importorskip("torch", reason="torch is optional")
    from mpidist.compress import CompressedAllreduce, make_compressor
    ca_t = CompressedAllreduce(make_compressor("fp16"), comm)
    ca_n = CompressedAllreduce(make_compressor("fp16"), comm)
    got = ca_t(torch.from_numpy(data(comm.rank)))
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), ca_n(data(comm.rank)))


def test_jax_array_out_of_place(comm):
    jnp = pytest.importorskip("jax.numpy", reason="JAX is optional")
    x = jnp.asarray(data(comm.rank))
    res = allreduce(x, comm=comm)
    np.testing.assert_array_equal(np.asarray(res), expected(comm))
    np.testing.assert_array_equal(np.asarray(x), data(comm.rank))       # unchanged


class DLPackOnly:
    """An object that offers DLPack and nothing else."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_and_buffer_protocol(comm):
    a = data(comm.rank)
    res = allreduce(DLPackOnly(a), comm=comm)
    assert isinstance(res, DLPackOnly)
    np.testing.assert_array_equal(a, expected(comm))
    buf = array.array("f", data(comm.rank))
    assert allreduce(buf, comm=comm) is buf
    np.testing.assert_array_equal(np.asarray(buf), expected(comm))
    ro = memoryview(data(comm.rank).tobytes()).cast("f")          # read-only: out of place
    np.testing.assert_array_equal(allreduce(ro, comm=comm), expected(comm))


def test_not_an_array_raises_on_every_rank(comm):
    with pytest.raises(TypeError, match="torch tensor, DLPack"):
        allreduce(object(), comm=comm)
