"""Write a checkpoint at this world size and read back every checkpoint in the directory,
whatever world size wrote it (run by test_jobs.py at p = 1..4).

    python -m mpidist.launcher -n 3 -- python tests/checkpoint/reshard_job.py DIR [--no-write]

The tensors are the same at every world size; how they are held is not: replicated,
sharded by chunk() (ranks in reverse order), and held by the last rank only.
Rank 0 appends "read <file> at <size>" lines to DIR/log.txt.
"""
import os
import sys

import numpy as np

from mpidist.checkpoint import open_checkpoint, write_checkpoint
from mpidist.comm import default_communicator
from mpidist.partition import chunk


class Piece:
    def __init__(self, shape, offset, data):
        self.shape, self.offset, self.data = shape, offset, data


def tensors():
    rng = np.random.default_rng(123)
    return {"params/emb": rng.standard_normal((37, 11)).astype(np.float32),
            "optim/exp_avg_sq/emb": rng.random((37, 11)),
            "ps/shard": rng.integers(0, 1000, (5, 4, 3)).astype(np.int32)}


def main(argv):
    directory, write = argv[0], "--no-write" not in argv
    comm = default_communicator()
    full = tensors()
    if write:
        o, c = chunk(full["optim/exp_avg_sq/emb"].size, comm.size - 1 - comm.rank, comm.size)
        mine = {"params/emb": full["params/emb"],
                "optim/exp_avg_sq/emb": Piece((37, 11), o, full["optim/exp_avg_sq/emb"].reshape(-1)[o:o + c])}
        if comm.rank == comm.size - 1:
            mine["ps/shard"] = full["ps/shard"]
        write_checkpoint(os.path.join(directory, f"w{comm.size}.h5"), mine, step=comm.size,
                         comm=comm)
    names = comm.comm.bcast(sorted(n for n in os.listdir(directory) if n.endswith(".h5")), root=0)
    for name in names:
        with open_checkpoint(os.path.join(directory, name), comm=comm) as src:
            assert src.world_size == int(name[1:-3]) == src.step
            for key, t in full.items():
                offset, part = src.read_chunk(key)
                o, c = chunk(t.size, comm.rank, comm.size)
                assert offset == o and np.array_equal(part, t.reshape(-1)[o:o + c]), (name, key)
            assert np.array_equal(src.read_full("params/emb"), full["params/emb"])
        if comm.rank == 0:
            with open(os.path.join(directory, "log.txt"), "a") as fh:
                fh.write(f"read {name} at {comm.size}\n")
    comm.comm.Barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
