"""`mpidist train` with a rank that SIGKILLs itself inside a checkpoint write, for the
fault-tolerance tests (kills during a step: env MPIDIST_FT_KILL, mpidist.ft.recovery).

    python _job.py CONFIG [mpidist train arguments]     env MPIDIST_TEST_CKPT_KILL="RANK@STEP"

RANK (of the job at start) opens the checkpoint file of step STEP in its turn to write its
part, then kills itself with SIGKILL, first writing the time to <out_dir>/killed-rank<RANK>.txt.
"""
import os
import signal
import sys
import time

import h5py
from mpi4py import MPI

from mpidist.checkpoint.manager import CheckpointManager
from mpidist.engine.train import main

RANK = MPI.COMM_WORLD.Get_rank()
PLAN = [tuple(int(v) for v in p.split("@")) for p in os.environ.get("MPIDIST_TEST_CKPT_KILL", "").split(",") if p]
MINE = {step for rank, step in PLAN if rank == RANK}
saving = {"step": None, "dir": "."}
save = CheckpointManager.save


def save_checkpoint(self, step, *args, **kwargs):
    saving["step"], saving["dir"] = step, os.path.dirname(self.directory)
    try:
        return save(self, step, *args, **kwargs)
    finally:
        saving["step"] = None


class File(h5py.File):
    """h5py.File that kills this rank when it opens the checkpoint in its turn to write."""

    def __init__(self, name, mode="r", *args, **kwargs):
        super().__init__(name, mode, *args, **kwargs)
        if mode == "r+" and saving["step"] in MINE:
            with open(os.path.join(saving["dir"], f"killed-rank{RANK}.txt"), "w") as fh:
                fh.write(f"{time.time()}\n")
            os.kill(os.getpid(), signal.SIGKILL)


CheckpointManager.save = save_checkpoint
h5py.File = File

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
