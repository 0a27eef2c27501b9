"""Helper of test_torch_checkpoint (run under mpiexec): train a small torch MLP with
mpidist.torch, checkpoint at step 3 or resume from it, print the global losses as JSON."""
import json
import sys

import torch
from mpi4py import MPI

import mpidist.torch as mt
from mpidist.comm import Communicator
from mpidist.torch.checkpoint import load_checkpoint, save_checkpoint

GLOBAL_BATCH, STEPS, SAVE_AT = 12, 6, 3


def main(mode, path, zero, out):
    comm = Communicator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = mt.DistributedOptimizer(model, "adamw", lr=1e-2, comm=comm, zero=int(zero))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(GLOBAL_BATCH, 8, generator=g),
             torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)) for _ in range(STEPS)]
    first = 0
    if mode == "resume":
        first = load_checkpoint(path, opt, model=model)
    per = GLOBAL_BATCH // comm.size
    losses = {}
    for step in range(first, STEPS):
        x, y = data[step]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[comm.rank * per:(comm.rank + 1) * per]),
                                                 y[comm.rank * per:(comm.rank + 1) * per])
        loss.backward()
        opt.step()
        losses[step] = comm.comm.allreduce(loss.item()) / comm.size
        if mode == "first" and step + 1 == SAVE_AT:
            save_checkpoint(path, opt, SAVE_AT, model=model)
    opt.close()
    if comm.rank == 0:
        with open(out, "w") as fh:
            json.dump(losses, fh)
    MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
