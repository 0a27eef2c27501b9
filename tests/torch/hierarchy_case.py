"""One training run of mpidist.torch against one process on the global batch, shared by the
node-split test (tests/torch/test_hierarchy.py) and the simulated-cluster check
(tests/simcluster/torch_check.py). Returns the largest relative difference of the parameters."""
import torch
from mpi4py import MPI

import mpidist.torch as mt

BATCH = 6                 # samples per rank
STEPS = 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48),
                               torch.nn.Tanh(), torch.nn.Linear(48, 10))


def _batch(step: int, size: int):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH * size, 32, generator=gen, dtype=torch.float64).float()
    y = torch.randint(0, 10, (BATCH * size,), generator=gen)
    return x, y


def max_rel_diff(comm, algorithm: str = "auto", bucket_mb: float = 0.004,
                 compression=None) -> float:
    """Train STEPS steps of momentum SGD on comm (a Communicator) with small buckets (several
    per step), and the same steps in one process on the whole batch; the largest relative
    difference between the two models' parameters."""
    net, ref = _model(), _model()
    opt = mt.DistributedOptimizer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                  comm=comm, bucket_mb=bucket_mb, algorithm=algorithm,
                                  compression=compression)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    lo, hi = comm.rank * BATCH, (comm.rank + 1) * BATCH
    for step in range(STEPS):
        x, y = _batch(step, comm.size)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
        ropt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ropt.step()
    worst = 0.0
    for a, b in zip(net.parameters(), ref.parameters()):
        worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)))
    opt.close()
    return comm.comm.allreduce(worst, op=MPI.MAX)
