"""An existing NumPy code joins data-parallel training through DistributedOptimizer alone.

The code below is a plain softmax-regression trainer on the handwritten digits: its own
weight arrays, its own gradient formula, its own mpi4py communicator. Three lines make it
data parallel: wrap the arrays, pass the gradients to step(), read the shard by rank.

    python -m mpidist.launcher -n 4 -- python jobs/existing_code.py
    mpiexec -n 4 python jobs/existing_code.py
    srun -n 4 python jobs/existing_code.py
"""
import sys

import numpy as np
from mpi4py import MPI
from sklearn.datasets import load_digits

from mpidist.engine import DistributedOptimizer
from mpidist.optim import build_optimizer
from mpidist.partition import chunk


def gradients(w, b, x, onehot, n_global):
    """Softmax cross-entropy summed over x, divided by the global batch size."""
    z = x @ w + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    d = (p - onehot) / n_global
    return [x.T @ d, d.sum(axis=0)]


def main(comm=MPI.COMM_WORLD, epochs: int = 30, batch: int = 128) -> float:
    digits = load_digits()
    split = np.random.default_rng(1).permutation(len(digits.target))     # same on every rank
    x = (digits.data[split] / 16.0).astype(np.float32)
    y = digits.target[split]
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
    onehot = np.eye(10, dtype=np.float32)[y_train]
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.01, (64, 10)).astype(np.float32)
    b = np.zeros(10, np.float32)

    # the three mpidist lines: wrap the arrays (rank 0's values are broadcast), ...
    dopt = DistributedOptimizer.for_arrays([w, b], lambda layout: build_optimizer("adamw", layout, lr=0.01, weight_decay=0.0),
                                           comm=comm, algorithm="ring", op="sum")
    rank, size = comm.Get_rank(), comm.Get_size()
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(len(x_train))     # same on every rank
        for start in range(0, len(order) - batch + 1, batch):
            lo, count = chunk(batch, rank, size)                           # ... read my rows, ...
            idx = order[start + lo:start + lo + count]
            dopt.step(gradients(w, b, x_train[idx], onehot[idx], batch))   # ... and step.
    accuracy = float(((x_test @ w + b).argmax(axis=1) == y_test).mean())
    if rank == 0:
        print(f"existing code on {size} ranks: test accuracy {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    sys.exit(0 if main() >= 0.9 else 1)
