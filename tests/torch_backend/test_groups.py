"""Subgroups over "mpidist": new_group and DeviceMesh dimensions are MPI sub-communicators."""
import pytest

torch = pytest.importorskip("torch", reason="needs torch (scripts/setup_env.sh installs it)")
import torch.distributed as dist  # noqa: E402


def test_new_group_even_and_odd_ranks(groups):
    size, rank = dist.get_world_size(), dist.get_rank()
    evens = dist.new_group([r for r in range(size) if r % 2 == 0])
    odds = dist.new_group([r for r in range(size) if r % 2 == 1]) if size > 1 else None
    mine = [r for r in range(size) if r % 2 == rank % 2]
    group = evens if rank % 2 == 0 else odds
    assert dist.get_world_size(group) == len(mine)
    assert dist.get_rank(group) == mine.index(rank)
    t = torch.full((5,), float(rank))
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.full((5,), float(sum(mine))))
    # a broadcast from the subgroup's last member (a global rank)
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=mine[-1], group=group)
    assert torch.equal(b, torch.full((3,), float(mine[-1])))


def test_new_group_with_an_algorithm(groups):
    """pg_options={"algorithm": name} picks mpidist's allreduce algorithm for one group."""
    size = dist.get_world_size()
    ring = dist.new_group(list(range(size)), pg_options={"algorithm": "ring"})
    t = torch.arange(1000, dtype=torch.float64) + dist.get_rank()
    dist.all_reduce(t, group=ring)
    expected = torch.arange(1000, dtype=torch.float64) * size + size * (size - 1) // 2
    assert torch.equal(t, expected)
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        dist.new_group(list(range(size)), pg_options={"algorithm": "nonesuch"})


@pytest.mark.mpi(min_size=4)
def test_device_mesh_2x2(groups):
    if dist.get_world_size() != 4:
        pytest.skip("a 2x2 mesh takes exactly 4 ranks")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    for dim, members in (("dp", [rank % 2, rank % 2 + 2]), ("tp", [rank // 2 * 2, rank // 2 * 2 + 1])):
        group = mesh[dim].get_group()
        assert dist.get_backend(group) == "mpidist"
        t = torch.full((4,), float(rank))
        dist.all_reduce(t, group=group)
        assert torch.equal(t, torch.full((4,), float(sum(members)))), dim
        outs = [torch.empty(1) for _ in range(2)]
        dist.all_gather(outs, torch.tensor([float(rank)]), group=group)
        assert [o.item() for o in outs] == [float(m) for m in members], dim
