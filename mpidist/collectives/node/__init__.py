"""The node's shared-memory window, the one mechanism for reducing among the ranks of a node.

    window.py      Window: per-rank slices and header lines in MPI shared windows, the one
                   barrier (counters polled, then napping; a deadline where asked), and the
                   mismatch guard carried by it (digests in the headers); usable(comm),
                   window_of(comm) (comm's own, freed with it)
    reductions.py  reduce_chunk (one chunk over every rank's slice, in rank order: the same
                   bits on every rank), and allreduce (begin / ready / finish),
                   reduce_scatter, allgather over a Window
    buffer.py      SharedBuffer: a flat buffer that lives in a window, reduced in place on a
                   worker thread (mpidist.torch's gradients, ZeRO's shards)

Users: the "shm" algorithm (shm.py), SharedBuffer, and the torch backend's node path (its
guard and DDP's buckets). See docs/ARCHITECTURE.md (collectives).
"""
from mpidist.collectives.node.buffer import DTYPES, SharedBuffer
from mpidist.collectives.node.window import Window, usable, window_of

__all__ = ["Window", "SharedBuffer", "DTYPES", "usable", "window_of"]
