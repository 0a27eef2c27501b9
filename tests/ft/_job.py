"""`mpidist train` with ranks that SIGKILL themselves, for the fault-tolerance tests.

    python _job.py CONFIG [mpidist train arguments]     env MPIDIST_TEST_KILL="RANK@STEP[:WHERE],..."

RANK (of the job at start) kills itself with SIGKILL once it has completed STEP steps:
WHERE = "step" (default): a random 0-50 ms into the next step (forward, backward or the
gradient exchange); "checkpoint": with the checkpoint file of step STEP open for its part.
Before dying it writes the time to <out_dir>/killed-rank<RANK>.txt.
"""
import os
import random
import signal
import sys
import threading
import time

import h5py
from mpi4py import MPI

import mpidist.engine.loop as loop
from mpidist.checkpoint.manager import CheckpointManager
from mpidist.engine.train import main

RANK = MPI.COMM_WORLD.Get_rank()
PLAN = [(int(r), int(s), (w or "step")) for r, s, w in
        ((p.split("@")[0], *p.split("@")[1].split(":", 1), "")[:3]
         for p in os.environ.get("MPIDIST_TEST_KILL", "").split(",") if p)]
MINE = [(s, w) for r, s, w in PLAN if r == RANK]
OUT = {"dir": "."}


def die() -> None:
    with open(os.path.join(OUT["dir"], f"killed-rank{RANK}.txt"), "w") as fh:
        fh.write(f"{time.time()}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def build_strategy(config, comm, meta):
    OUT["dir"] = config["job"]["out_dir"]
    strategy = loop_build(config, comm, meta)
    step = strategy.train_step

    def train_step(x, y, global_count=None):
        if (strategy.step, "step") in MINE:
            threading.Timer(random.Random(strategy.step).uniform(0, 0.05), die).start()
        return step(x, y, global_count=global_count)

    strategy.train_step = train_step
    return strategy


saving = {"step": None}
save = CheckpointManager.save


def save_checkpoint(self, step, *args, **kwargs):
    saving["step"] = step
    try:
        return save(self, step, *args, **kwargs)
    finally:
        saving["step"] = None


class File(h5py.File):
    """h5py.File that kills this rank when it opens the checkpoint in its turn to write."""

    def __init__(self, name, mode="r", *args, **kwargs):
        super().__init__(name, mode, *args, **kwargs)
        if mode == "r+" and (saving["step"], "checkpoint") in MINE:
            die()


loop_build = loop.build_strategy
loop.build_strategy = build_strategy
CheckpointManager.save = save_checkpoint
h5py.File = File

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
