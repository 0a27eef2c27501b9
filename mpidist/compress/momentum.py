"""The compressed momentum average of 1-bit Adam and 1-bit LAMB, with error feedback on
the sending side and on the side that reduces each chunk (Tang et al. 2021, Algorithm 1;
Li et al. 2021): the "worker" and "server" errors, with chunk r of the buffer served by
rank r, so no parameter server is needed.

Per step, for an n-element flat momentum whose chunk r is chunk(n, r, size):
  1. worker: each rank compresses its momentum plus its worker residual, one piece per
     chunk owner (the compressed reduce-scatter; a buffer may go in ranges, each with its
     own residual)
  2. server: the owner of chunk r sums its pieces in rank order, divides by size, adds its
     server residual, compresses, and keeps what that dropped
  3. every rank gathers the owners' payloads and decodes them into the averaged momentum:
     the same bits on every rank, in `momentum` (times `scale`: 1-bit Adam's preconditioning)
"""
from __future__ import annotations

import copy

import numpy as np
from mpi4py import MPI

from mpidist.comm import as_communicator
from mpidist.compress.allreduce import CompressedAllreduce
from mpidist.compress.wire import pack, unpack
from mpidist.compress.base import Compressor
from mpidist.kernels.backend import get_array_module, synchronize, to_numpy
from mpidist.partition import chunk

__all__ = ["MomentumAllreduce", "allgather_shards", "check_momentum_compressor"]


def check_momentum_compressor(compressor) -> None:
    """TypeError / ValueError unless compressor can carry the momentum: a Compressor with
    error feedback whose payloads decode one by one (not PowerSGD)."""
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be a Compressor (make_compressor(name, ...)), "
                        f"got {type(compressor).__name__}")
    if not compressor.error_feedback:
        raise ValueError(f"the momentum compressor {compressor.name!r} needs error "
                         f"feedback (error_feedback=True)")
    if not compressor.decodes_alone:
        raise ValueError(f"compressor {compressor.name!r} cannot compress the momentum: "
                         f"its payloads only decode once summed over all ranks (use "
                         f"sign, topk, randomk or qsgd)")


class MomentumAllreduce:
    """The two-sided compressed average of an n-element momentum over comm.

    compressor: a Compressor with error feedback (make_compressor(name, ...)); the worker
    side uses one copy per buffer range, the server side one more for my chunk.
    After a step: `momentum` (n float32, the averaged momentum every rank holds),
    bytes_sent (that step), total_bytes_sent.
    """

    def __init__(self, compressor: Compressor, n: int, comm=None, xp=np):
        check_momentum_compressor(compressor)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        self.comm = as_communicator(comm)
        self.n = int(n)
        self.offset, self.count = chunk(self.n, self.comm.rank, self.comm.size)
        self.server = copy.deepcopy(compressor)
        self.server.stream = self.comm.rank
        # nonfinite="skip": an inf/NaN anywhere comes back NaN (residuals untouched) and the
        # caller skips the step on every rank
        self.worker = CompressedAllreduce(compressor, self.comm, nonfinite="skip")
        self.momentum = xp.zeros(self.n, np.float32)
        self.ready = False            # momentum holds the last average (else: gather it)
        self.bytes_sent = 0
        self.total_bytes_sent = 0
        self._sent = 0

    def __repr__(self) -> str:
        return (f"MomentumAllreduce({self.server!r}, n={self.n}, ranks={self.comm.size}, "
                f"chunk=[{self.offset}, {self.offset + self.count}))")

    # ---------------------------------------------------------------- the step
    def reduce_scatter(self, x, lo: int = 0):
        """1. (worker side) my chunk's part of the sum over ranks of the compressed
        x = m_i[lo:lo+len(x)], with this range's worker residual. Collective. An inf/NaN
        on any rank gives NaN on every rank (see worker.last_skipped)."""
        out = self.worker.reduce_scatter(x, lo=lo, n=self.n)
        self._sent += self.worker.bytes_sent
        return out

    def allgather(self, summed, scale=None):
        """2.-3. (server side) summed: my chunk of the sum over ranks (what reduce_scatter
        left here, all ranges added); returns `momentum`, the average, whole, times scale
        (n float32) if given. Collective."""
        p = self.comm.size
        xp = get_array_module(summed)
        if getattr(summed, "shape", None) != (self.count,):
            raise ValueError(f"summed must be my chunk of {self.count} elements, got "
                             f"{getattr(summed, 'shape', None)}")
        if get_array_module(self.momentum) is not xp:
            self.momentum = xp.asarray(self.momentum)
        # 2. average, add my server residual, compress, keep what it dropped
        s = xp.ascontiguousarray(summed, dtype=np.float32) * np.float32(1.0 / p)
        counts = [chunk(self.n, r, p) for r in range(p)]
        contexts = [self.server.context(c) for _, c in counts]   # before compress's step
        payload, _ = self.server.compress(s)
        dtypes = [a.dtype for a in payload]
        msg = pack(payload)
        # 3. every owner's payload to every rank, decoded in place
        sizes = np.array(self.comm.comm.allgather(int(msg.nbytes)), np.int64)
        recv = np.empty(int(sizes.sum()), np.uint8)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        synchronize(summed)
        self.comm.comm.Allgatherv(msg, [recv, (sizes, displs), MPI.BYTE])
        for r, (off, c) in enumerate(counts):
            part = self.momentum[off:off + c]
            part[...] = 0
            if c:
                ctx = {k: xp.asarray(v) if hasattr(v, "shape") else v
                       for k, v in contexts[r].items()}
                got = unpack(recv[displs[r]:displs[r] + sizes[r]], dtypes)
                self.server.decode_add(tuple(xp.asarray(a) for a in got), ctx, part)
        if scale is not None:
            self.momentum *= scale
        self._sent += (p - 1) * int(msg.nbytes)
        self.bytes_sent, self._sent = self._sent, 0
        self.total_bytes_sent += self.bytes_sent
        self.ready = True
        return self.momentum

    def gather(self, shard, offset: int):
        """Set `momentum` to the whole of what every rank's shard [offset, offset+len)
        holds, uncompressed (after the warm-up, or a restart: the optimizers' exp_avg).
        Collective; not counted in bytes_sent."""
        self.momentum = allgather_shards(self.comm, shard, offset, self.n)
        self.ready = True
        return self.momentum

    # ---------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        """This rank's state: the worker side's per range (CompressedAllreduce.state_dict),
        the server compressor's (residual over my chunk). The momentum is the optimizer's
        exp_avg and is gathered from it on load."""
        return {"worker": self.worker.state_dict(), "server": self.server.state_dict(),
                "chunk": [self.offset, self.count]}

    def load_state_dict(self, sd: dict) -> None:
        if list(sd.get("chunk", [])) != [self.offset, self.count]:
            raise ValueError(f"momentum exchange state is for chunk {sd.get('chunk')}, this "
                             f"rank serves [{self.offset}, {self.count}); restore at the same "
                             f"world size, or through the checkpoint's global tensors")
        self.worker.load_state_dict(sd["worker"])
        self.server.load_state_dict(sd["server"])
        self.ready = False


def allgather_shards(comm, shard, offset: int, n: int):
    """The n-element float32 vector whose ranges [offset, offset+len(shard)) the ranks hold
    (they tile [0, n)), whole on every rank; a shard that is already whole is copied."""
    xp = get_array_module(shard)
    host = np.ascontiguousarray(to_numpy(shard), dtype=np.float32)
    if host.shape[0] == n:
        return shard.astype(np.float32, copy=True)
    full = np.zeros(n, np.float32)
    for off, a in comm.comm.allgather((int(offset), host)):
        full[off:off + a.shape[0]] = a
    return full if xp is np else xp.asarray(full)
