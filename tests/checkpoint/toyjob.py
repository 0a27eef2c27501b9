"""A small deterministic training job for the checkpoint and SLURM tests: least squares with
momentum, weights replicated, the momentum sharded ZeRO-1 style by chunk(), so a checkpoint
holds both kinds of tensor and resuming on another rank count must reshard.

    python -m mpidist.launcher -n 3 -- python tests/checkpoint/toyjob.py --dir D --steps 12
    srun --mpi=pmix -n 2 python tests/checkpoint/toyjob.py --dir D --steps 12

Every step uses a global batch drawn from a generator seeded by (seed, step), split by rows
over the ranks, so the trajectory does not depend on the world size (up to summation order).
Resumes from the newest good checkpoint in --dir; SIGTERM/SIGUSR1 -> checkpoint, a note in
DIR/preempted.<rank>, exit 75.
Rank 0 writes --out (JSON: final weights, losses, where it resumed from).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from mpidist.checkpoint import REQUEUE_EXIT_CODE, CheckpointManager, Preemption
from mpidist.comm import default_communicator
from mpidist.partition import chunk

DIM, BATCH, LR, BETA = 257, 64, 0.02, 0.9


def batch(seed: int, step: int):
    rng = np.random.default_rng([seed, step])
    x = rng.standard_normal((BATCH, DIM))
    w_true = np.random.default_rng([seed]).standard_normal(DIM)
    return x, x @ w_true + 0.01 * rng.standard_normal(BATCH)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4, help="checkpoint every this many steps")
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to be signalled)")
    p.add_argument("--stop-at", type=int, default=None, help="exit 0 after this step (no save)")
    p.add_argument("--die-rank", type=int, default=None, help="this rank SIGKILLs itself ...")
    p.add_argument("--die-step", type=int, default=None, help="... at this step")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    comm = default_communicator()
    os.makedirs(a.dir, exist_ok=True)
    with open(os.path.join(a.dir, f"pid.{comm.rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    mgr = CheckpointManager(a.dir, keep=a.keep, comm=comm)
    lo, n = chunk(DIM, comm.rank, comm.size)
    w, m, start, losses = np.zeros(DIM), np.zeros(n), 0, []
    resumed_from = None
    src = mgr.open_latest()
    if src is not None:
        with src:
            src.require({"params/w": (DIM,), "optim/momentum/w": (DIM,)})
            w = src.read("params/w").astype(np.float64)
            m = src.read("optim/momentum/w", lo, n).astype(np.float64)
            start, losses = src.step, list(src.scalars["losses"])
            resumed_from = {"step": src.step, "world_size": src.world_size, "path": src.path}

    def save(step):
        mgr.save(step, {"params/w": w,
                        "optim/momentum/w": _Piece((DIM,), lo, m)},
                 epoch=step // 4, scalars={"losses": losses},
                 meta={"job": "toyjob", "dim": DIM, "lr": LR},
                 rank_meta={"pid": os.getpid()})

    status = 0
    with Preemption(comm) as pre:
        for step in range(start, a.steps):
            if a.die_step == step and a.die_rank == comm.rank:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(a.seed, step)
            r0, rn = chunk(BATCH, comm.rank, comm.size)
            xr, yr = x[r0:r0 + rn], y[r0:r0 + rn]
            resid = xr @ w - yr
            part = np.concatenate([xr.T @ resid, [resid @ resid]]) / BATCH
            total = np.empty_like(part)
            comm.comm.Allreduce(part, total, op=MPI.SUM)
            losses.append(float(total[-1]))
            # ZeRO-1: my shard of the momentum updates my shard of w, then everyone gathers w
            m = BETA * m + total[:-1][lo:lo + n]
            shards = comm.comm.allgather(w[lo:lo + n] - LR * m)
            w = np.concatenate(shards)
            done = step + 1
            time.sleep(a.sleep)
            if done % a.every == 0 or done == a.steps:
                save(done)
            if pre.should_stop():
                if done % a.every and done != a.steps:
                    save(done)
                note = (f"rank {comm.rank}: preempted by signal {pre.received}, checkpoint at "
                        f"step {done}, exiting {REQUEUE_EXIT_CODE}\n")
                sys.stdout.write(note)
                sys.stdout.flush()
                with open(os.path.join(a.dir, f"preempted.{comm.rank}"), "a") as fh:
                    fh.write(note)       # mpiexec may drop the others' output when one exits
                status = REQUEUE_EXIT_CODE
                break
            if a.stop_at == done:
                break
    if comm.rank == 0 and a.out and status == 0:
        with open(a.out, "w") as fh:
            json.dump({"w": w.tolist(), "losses": losses, "resumed_from": resumed_from,
                       "world_size": comm.size, "restart": os.environ.get("SLURM_RESTART_COUNT")}, fh)
    comm.comm.Barrier()
    return status


class _Piece:
    def __init__(self, shape, offset, data):
        self.shape, self.offset, self.data = shape, offset, data


if __name__ == "__main__":
    sys.exit(main())
