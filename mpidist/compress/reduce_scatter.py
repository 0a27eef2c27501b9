"""The compressed reduce-scatter (ZeRO stages 2 and 3): each rank gets its shard of the sum
over ranks of every rank's compressed gradient.

A buffer is the global range [lo, lo + m) of an n-element flat gradient whose shards are
chunk(n, r, size) (mpidist.partition). Per call, on every rank:

  1. split: the piece of the buffer each rank owns, [lo, lo + m) ∩ chunk(n, r, size)
  2. encode: every piece compressed on its own, in one compressor call for the buffer;
     error feedback keeps, per destination piece, what that piece's encoding dropped
  3. exchange: the packed payloads' byte counts by alltoall, then the payloads by
     alltoallv (my own piece's payload stays here)
  4. sum: the owner decompresses the `size` payloads of its piece in rank order into a
     float32 zero vector: the result does not depend on arrival order, and it is the
     decompress-then-sum of every rank's payload, as the gather allreduce forms it

Bytes sent: the payloads to the other ranks, with their headers and padding (pack()).
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpidist.compress.wire import pack, unpack
from mpidist.kernels.backend import get_array_module
from mpidist import partition

__all__ = ["reduce_scatter"]


def _raw_pieces(x, pieces):
    """The uncompressed path (warm-up): every piece as float32, decoded by adding it."""
    return [((x[s:s + c],), {"n": c}) for s, c in pieces]


def reduce_scatter(comm, compressor, x, lo: int, n: int):
    """(my piece of the sum, bytes this rank sent). x: float32, the range [lo, lo + len(x))
    on every rank; compressor None: float32 pieces (warm-up). Collective over comm."""
    p, me = comm.size, comm.rank
    xp = get_array_module(x)
    pieces = partition.pieces(lo, lo + x.shape[0], n, p)
    # 1.-2. split and encode, one payload per owner
    if compressor is None:
        encoded = _raw_pieces(x, pieces)

        def decode_add(payload, ctx, out):
            out += payload[0]
    else:
        encoded = compressor.compress_pieces(x, pieces)
        decode_add = compressor.decode_add
    dtypes = [a.dtype for a in encoded[me][0]]
    messages = [pack(payload) for payload, _ in encoded]
    # 3. exchange: byte counts, then the payloads (nothing to myself or for empty pieces)
    send_counts = np.array([0 if r == me or not pieces[r][1] else messages[r].nbytes
                            for r in range(p)], np.int64)
    recv_counts = np.empty(p, np.int64)
    comm.comm.Alltoall(send_counts, recv_counts)
    send = np.concatenate([messages[r] for r in range(p) if send_counts[r]] or
                          [np.empty(0, np.uint8)])
    recv = np.empty(int(recv_counts.sum()), np.uint8)
    sdispls = np.concatenate([[0], np.cumsum(send_counts)[:-1]])
    rdispls = np.concatenate([[0], np.cumsum(recv_counts)[:-1]])
    comm.comm.Alltoallv([send, (send_counts, sdispls), MPI.BYTE],
                        [recv, (recv_counts, rdispls), MPI.BYTE])
    # 4. my piece: every rank's payload decompressed and summed in rank order
    ctx = encoded[me][1]
    out = xp.zeros(pieces[me][1], dtype=np.float32)
    for r in range(p if out.size else 0):
        msg = messages[me] if r == me else recv[rdispls[r]:rdispls[r] + recv_counts[r]]
        decode_add(tuple(xp.asarray(a) for a in unpack(msg, dtypes)), ctx, out)
    return out, int(send_counts.sum())

