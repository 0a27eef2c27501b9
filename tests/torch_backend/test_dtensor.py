"""DeviceMesh and DTensor over "mpidist": the redistributions (torch's functional
collectives, called from C++ through the group) and a sharded matmul give what the same
steps give over gloo."""
import pytest

torch = pytest.importorskip("torch", reason="needs torch (scripts/setup_env.sh installs it)")
import torch.distributed as dist  # noqa: E402

tensor_api = pytest.importorskip("torch.distributed.tensor", reason="needs DTensor")
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: E402


def _steps(mesh):
    """Redistributions and a matmul on a 1-D mesh; every result as a local tensor."""
    size, rank = mesh.size(), mesh.get_local_rank()
    gen = torch.Generator().manual_seed(11)
    a = torch.randn(4 * size, 6, generator=gen, dtype=torch.float64)
    b = torch.randn(6, 3 * size, generator=gen, dtype=torch.float64)
    da = tensor_api.distribute_tensor(a, mesh, [Shard(0)])
    db = tensor_api.distribute_tensor(b, mesh, [Shard(1)])
    out = [da.redistribute(mesh, [Replicate()]).to_local(),          # all_gather
           da.redistribute(mesh, [Shard(1)]).to_local(),             # all_to_all
           (da @ db.redistribute(mesh, [Replicate()])).full_tensor()]
    part = tensor_api.DTensor.from_local(torch.full((5,), float(rank + 1), dtype=torch.float64),
                                         mesh, [Partial()])
    out.append(part.redistribute(mesh, [Replicate()]).to_local())    # all_reduce
    out.append(part.redistribute(mesh, [Shard(0)]).to_local())       # reduce_scatter
    return out, a @ b


def test_dtensor_on_a_mesh_equals_gloo(groups):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    assert dist.get_backend(mesh.get_group()) == "mpidist"
    ours, full = _steps(mesh)
    ref, _ = _steps(DeviceMesh.from_group(groups[1], "cpu"))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(ours[2], full, rtol=1e-12, atol=1e-12)
    size = dist.get_world_size()
    assert torch.equal(ours[3], torch.full((5,), size * (size + 1) / 2, dtype=torch.float64))
