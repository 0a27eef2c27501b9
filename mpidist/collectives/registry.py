"""Algorithm name -> allreduce function; all share `allreduce(comm, sendbuf, recvbuf, op)`.

sendbuf/recvbuf are 1-D contiguous buffers MPI may touch, of the accumulator dtype;
recvbuf may be sendbuf (in place). Every algorithm leaves the same bits on every rank.
"""
from __future__ import annotations

from mpidist.collectives import (dbtree, hierarchical, native, rabenseifner,
                                 recursive_doubling, ring, shm, tree)

__all__ = ["ALGORITHMS", "get_algorithm", "algorithm_names"]

ALGORITHMS = {
    "ring": ring.allreduce,
    "tree": tree.allreduce,
    "dbtree": dbtree.allreduce,
    "hierarchical": hierarchical.allreduce,
    "recursive_doubling": recursive_doubling.allreduce,
    "rabenseifner": rabenseifner.allreduce,
    "shm": shm.allreduce,
    "native": native.allreduce,
}


def algorithm_names(auto: bool = True) -> list[str]:
    return list(ALGORITHMS) + (["auto"] if auto else [])


def get_algorithm(name: str):
    """The allreduce function for `name`; ValueError listing the valid names otherwise."""
    try:
        return ALGORITHMS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown allreduce algorithm {name!r}; valid algorithms: "
                         f"{', '.join(algorithm_names())}") from None
