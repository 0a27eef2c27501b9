"""A small byte-level GPT written in plain PyTorch (mpidist.torch.models.GPT), trained data
parallel with mpidist.torch on the repository's sample text, with checkpoints and resume.

    python -m mpidist.launcher -n 2 -- python jobs/torch_gpt.py --steps 200
    mpiexec -n 4 python jobs/torch_gpt.py --resume
    srun -n 4 python jobs/torch_gpt.py --resume --zero 2

Every rank draws its own batch of --batch windows per step from a generator seeded by
(step, rank), so a resumed run sees the data it would have seen. Checkpoints (mpidist's
parallel-HDF5 format, mpidist.torch.checkpoint) go to --ckpt every --ckpt-every steps;
--resume continues from the newest one, at any rank count and ZeRO stage. SIGUSR1/SIGTERM
make every rank checkpoint and exit with 75 (requeue), as the other jobs do.
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import mpidist.torch as mt
from mpidist.checkpoint import REQUEUE_EXIT_CODE, CheckpointManager, Preemption
from mpidist.comm import Communicator
from mpidist.torch.checkpoint import load_checkpoint, save_checkpoint
from mpidist.torch.models import GPT, windows   # plain PyTorch (shared with the benches)

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="windows per rank")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2))
    p.add_argument("--data", default=os.path.join(HERE, "..", "data", "sample.txt"))
    p.add_argument("--ckpt", default=os.path.join("results", "torch_gpt"))
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    if args.dim % args.heads:
        p.error("--dim must be a multiple of --heads")
    torch.set_num_threads(1)
    comm = Communicator()
    with open(args.data, "rb") as fh:
        text = torch.frombuffer(bytearray(fh.read()), dtype=torch.uint8)
    torch.manual_seed(0)
    model = GPT(args.block, args.dim, args.layers, args.heads)
    opt = mt.DistributedOptimizer(model, "adamw", lr=args.lr, weight_decay=0.01,
                                  zero=args.zero, comm=comm)
    manager = CheckpointManager(args.ckpt, keep=2, comm=comm)
    start = 0
    if args.resume:
        reader = manager.open_latest()
        if reader is not None:
            with reader:
                start = load_checkpoint(reader, opt, model=model)
    if comm.rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"GPT {n / 1e6:.2f}M parameters, {comm.size} ranks, zero={args.zero}, "
              f"from step {start}", flush=True)
    t0 = time.perf_counter()
    with Preemption(comm) as pre:
        for step in range(start, args.steps):
            x, y = windows(text, step, comm.rank, args.batch, args.block)
            opt.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            done = step + 1
            if done % 10 == 0 or done == args.steps:
                mean = comm.comm.allreduce(loss.item()) / comm.size
                if comm.rank == 0:
                    print(f"step {done} loss {mean:.4f} "
                          f"({(time.perf_counter() - t0) / (done - start):.3f} s/step)", flush=True)
            if done % args.ckpt_every == 0 or done == args.steps:
                save_checkpoint(manager, opt, done, model=model)
            if pre.should_stop():
                save_checkpoint(manager, opt, done, model=model)
                opt.close()
                sys.exit(REQUEUE_EXIT_CODE)
    opt.close()


if __name__ == "__main__":
    main()
