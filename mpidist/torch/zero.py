"""ZeRO stages 1 and 2 for torch modules: each rank keeps and updates the optimizer state
of its shard, chunk(numel, rank, size) of the flat buffer, then the updated shards are
allgathered into every rank's whole parameter buffer.

  stage 1: the gradient buckets are allreduced (as data parallel); each rank updates its
           shard from the whole sum;
  stage 2: the buckets are reduce-scattered onto the shards' owners (in the shared window
           while backward runs; else one reduce-scatter in step()), not allreduced.
torch's autograd still writes whole gradients, so stage 2 saves communication, not
gradient memory; a caller's synchronize() gathers the reduced shards, so that `.grad` means
what it means at the other stages (clip_grad_norm_ after it sees the whole gradient).
LARS/LAMB's per-tensor norms are summed over the shards.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpidist.collectives import allgather, reduce_scatter
from mpidist.partition import chunk
from mpidist.torch.exchange import Allreduce

__all__ = ["Zero", "shard_of"]


def shard_of(n: int, comm, stage: int) -> tuple[int, int]:
    """[a, b): the range of the n-element buffer this rank's optimizer updates."""
    offset, count = chunk(n, comm.rank, comm.size) if stage else (0, n)
    return offset, offset + count


class Zero(Allreduce):
    """ZeRO stage 1 or 2 over storage's flat buffers (the exchange interface of
    mpidist.torch.exchange); needs an mpidist optimizer over [shard)."""

    def __init__(self, storage, comm, stage: int, *, algorithm: str = "auto"):
        super().__init__(storage, comm, algorithm=algorithm)
        self.stage = stage
        n = storage.layout.numel
        self.shard = shard_of(n, comm, stage)
        self.bounds = [chunk(n, r, comm.size)[0] for r in range(comm.size)] + [n]

    def in_window(self) -> bool:
        """Stage 1 allreduces in the window as data parallel does (stage 2 reduce-scatters:
        the hooks copy and check every gradient)."""
        return self.stage == 1 and super().in_window()

    def launch(self, lo: int, hi: int, own=()):
        if self.stage == 1 or self.comm.size == 1:
            return super().launch(lo, hi, own)
        shared = self.storage.shared    # without the window: one reduce-scatter in complete()
        return None if shared is None else shared.reduce_scatter_async(lo, hi, self.shard)

    def complete(self) -> bool | None:
        if self.storage.shared is not None:
            return super().complete() if self.stage == 1 else None
        if self.stage == 2 and self.comm.size > 1:
            a, b = self.shard
            g = self.storage.grads
            reduce_scatter(g, op="sum", comm=self.comm, out=g[a:b],
                           algorithm="auto" if self.algorithm == "auto" else "ring")
        return None

    def update(self, optimizer, scale: float) -> dict:
        a, b = self.shard
        out = optimizer.step(self.storage.params[a:b], self.storage.grads[a:b], finite=True,
                             loss_scale=scale, reduce_norms=self.reduce_norms)
        self.gather_params()
        return {"lr": out.lr, "optim_step": out.step}

    def reduce_norms(self, partials):
        """LARS/LAMB: per-tensor partial sums of squares summed over the shards."""
        if self.comm.size > 1:
            self.comm.comm.Allreduce(MPI.IN_PLACE, partials, op=MPI.SUM)
        return partials

    def reduce_max(self, values):
        """1-bit LAMB: a per-tensor maximum over the shards."""
        out = np.ascontiguousarray(values, dtype=np.float64)
        if self.comm.size > 1:
            self.comm.comm.Allreduce(MPI.IN_PLACE, out, op=MPI.MAX)
        return out

    def gather_grads(self) -> None:
        """Stage 2, collective: every rank's reduced shard into every rank's whole gradient
        buffer, so that `.grad` is the reduced gradient everywhere (synchronize() by the
        caller; step() alone updates from the shard and skips this)."""
        if self.stage == 2 and self.comm.size > 1:
            self._gather(self.storage.grads, self.storage.shared)

    def gather_params(self) -> None:
        """Every rank's updated shard into every rank's whole parameter buffer."""
        if self.comm.size > 1:
            self._gather(self.storage.params, self.storage.pshared)

    def _gather(self, flat, shared) -> None:
        """Collective: every rank's shard of flat into every rank's flat (in the window
        where flat lives in one, shared)."""
        if shared is not None:
            shared.allgather(self.bounds)
        else:
            a, b = self.shard
            allgather(flat[a:b].copy(), out=flat, comm=self.comm)
