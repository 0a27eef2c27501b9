"""Data sharding for torch DataLoaders with rank and size from MPI (no torch.distributed).

torch's DistributedSampler takes num_replicas and rank explicitly; this one takes them from
an mpidist communicator, so a script converted from DDP keeps its sampler line:

    sampler = mt.DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=b, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)            # the same permutation on every rank, new each epoch

Uneven datasets: drop_last=False pads with the first indices so every rank gets the same
number of samples (every rank must take the same number of steps); drop_last=True drops
the tail instead.
"""
from __future__ import annotations

from torch.utils.data.distributed import DistributedSampler as _TorchSampler

from mpidist.comm import as_communicator

__all__ = ["DistributedSampler"]


class DistributedSampler(_TorchSampler):
    """torch.utils.data.DistributedSampler over the ranks of comm (default: the world).
    Collective: the dataset's length and the settings are checked to be the same on every
    rank (a different seed would shard two different permutations)."""

    def __init__(self, dataset, comm=None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        c = as_communicator(comm)
        c.check_same((len(dataset), bool(shuffle), int(seed), bool(drop_last)),
                     "DistributedSampler settings (len(dataset), shuffle, seed, drop_last)")
        super().__init__(dataset, num_replicas=c.size, rank=c.rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
