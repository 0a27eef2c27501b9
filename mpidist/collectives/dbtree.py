"""Pipelined double binary tree allreduce (as NCCL does): two binary trees, each reducing
and broadcasting half of the buffer, built so that a rank that is a leaf in one tree is
an interior node in the other. Every rank then sends and receives about the same amount,
and the depth is only log2 p, so it scales to large rank counts where the ring's 2(p-1)
latency terms hurt.

Tree 0 is an in-order binary tree over positions 0..p-1 (odd positions are leaves);
tree 1 is the same shape over mirrored ranks (p even) or ranks shifted by one (p odd).

Cost: 2 ceil(log2 p) alpha + 2 n beta + n gamma (pipelined: the depth adds latency only).
"""
from __future__ import annotations

import functools

from mpidist.collectives.ops import Op
from mpidist.collectives.tree import Tree, tree_allreduce
from mpidist.partition import chunk

__all__ = ["allreduce", "inorder_tree", "double_trees"]


def inorder_tree(pos: int, size: int) -> tuple[int | None, tuple[int, ...]]:
    """(parent, children) of position `pos` in the in-order binary tree over 0..size-1:
    a range's root is its element with the most trailing zero bits (0 roots the whole)."""
    def root(lo, hi):
        return max(range(lo, hi + 1), key=lambda x: (x & -x) if x else 1 << 62)

    lo, hi, parent = 0, size - 1, None
    while True:
        r = root(lo, hi)
        if r == pos:
            kids = [root(a, b) for a, b in ((lo, r - 1), (r + 1, hi)) if a <= b]
            return parent, tuple(kids)
        parent = r
        lo, hi = (lo, r - 1) if pos < r else (r + 1, hi)


@functools.lru_cache(maxsize=256)
def double_trees(rank: int, size: int, n: int) -> tuple[Tree, Tree]:
    """This rank's two trees; tree t carries elements chunk(n, t, 2) (cached: pure data)."""
    maps = [lambda x: x,
            (lambda x: size - 1 - x) if size % 2 == 0 else (lambda x: (x + 1) % size)]
    unmaps = [lambda x: x,
              (lambda x: size - 1 - x) if size % 2 == 0 else (lambda x: (x - 1) % size)]
    trees = []
    for t in (0, 1):
        parent, children = inorder_tree(maps[t](rank), size)
        lo, count = chunk(n, t, 2)
        trees.append(Tree(None if parent is None else unmaps[t](parent),
                          tuple(unmaps[t](c) for c in children), lo, lo + count))
    return tuple(trees)


def allreduce(comm, sendbuf, recvbuf, op: Op):
    """Double binary tree allreduce (recvbuf may be sendbuf)."""
    return tree_allreduce(comm, sendbuf, recvbuf, op,
                          double_trees(comm.rank, comm.size, len(sendbuf)))
