"""The epoch order and every rank's rows of each global batch.

The global order of an epoch depends only on (seed, epoch): a permutation of all n samples
(or 0..n-1 without shuffle), cut into global batches of `batch_size`. A rank with data_rank r
of `size` replicas takes rows chunk(len(batch), r, size) of each batch. So every world size
sees the same global batches in the same order, and over an epoch the ranks' rows cover each
used sample exactly once.

The last partial batch: drop_last=True drops it (n // batch_size batches); drop_last=False
keeps it short, with no padding and no repeated samples (some ranks may get zero rows of it;
losses are normalised by the true global count, so its gradient is still exact).
See docs/ARCHITECTURE.md (data).
"""
from __future__ import annotations

import numpy as np

from mpidist.partition import chunk

__all__ = ["DistributedSampler", "epoch_order"]


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The global sample order of one epoch (int64), the same on every rank and world size."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n).astype(np.int64)


class DistributedSampler:
    """Iterate (global batch size, this rank's sample indices) over one epoch at a time."""

    def __init__(self, n: int, batch_size: int, *, rank: int | None = 0, size: int = 1, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True):
        if n < 1:
            raise ValueError(f"the dataset is empty (n={n})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > n:
            raise ValueError(f"batch_size {batch_size} exceeds the {n} samples with drop_last=True: "
                             "no batch would be left; lower batch_size or set drop_last = false")
        if rank is not None and not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside 0..{size - 1}")
        self.n, self.batch_size = int(n), int(batch_size)
        self.rank, self.size = rank, int(size)
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self.epoch = 0

    def __len__(self) -> int:
        """Global batches per epoch."""
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order batches() follows (the same on every rank)."""
        self.epoch = int(epoch)

    def batches(self):
        """Yield (global batch size, this rank's indices in global-batch row order) for the epoch."""
        order = epoch_order(self.n, self.seed, self.epoch, self.shuffle)
        for b in range(len(self)):
            batch = order[b * self.batch_size:(b + 1) * self.batch_size]
            if self.rank is None:
                yield len(batch), batch[:0]
                continue
            lo, count = chunk(len(batch), self.rank, self.size)
            yield len(batch), batch[lo:lo + count]

    def __iter__(self):
        return self.batches()
