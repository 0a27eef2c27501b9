"""Delayed Nesterov: the outer optimizer of asynchronous DiLoCo, run by the parameter server.

Asynchronous local SGD (Liu et al. 2024, arXiv 2401.09135, "Delayed Nesterov"): outer
gradients arrive one group at a time, each computed from a theta_outer that others have
moved since. Applying Nesterov momentum to every arrival accelerates along stale
directions; the delayed rule keeps the momentum still between every N arrivals:
    1. every push g (of one group): theta <- theta - lr * g / N, and buffer B <- B + g;
    2. once N pushes have arrived since the last momentum step:
       m <- momentum * m + B / N;  theta <- theta - lr * momentum * m;  B <- 0.
With N = the number of groups and one push from each, the N steps together are exactly
the synchronous outer step of torch's Nesterov SGD on the average outer gradient
(theta <- theta - lr * (g_avg + momentum * m)), so the two modes share their hyperparameters.
The paper's momentum activation c is 0 here (no momentum between momentum steps).
"""
from __future__ import annotations

import numpy as np

__all__ = ["DelayedNesterov"]


class DelayedNesterov:
    """The delayed Nesterov update of one server's shard [offset, offset + count).

    lr, momentum: the outer SGD (momentum 0: every push is plain SGD with lr / N);
    delay: N, the pushes per momentum step (>= 1).
    The parameter server hands step() the sum of the pushes it drained and how many they
    were (counts_pushes), so pushes that arrive together weigh as if they came one by one.
    """
    counts_pushes = True

    def __init__(self, offset: int, count: int, *, lr: float, momentum: float, delay: int):
        if isinstance(delay, bool) or not isinstance(delay, (int, np.integer)) or delay < 1:
            raise ValueError(f"delay must be an int >= 1 (pushes per momentum step), got {delay!r}")
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"need lr > 0 and 0 <= momentum < 1, got lr={lr!r}, momentum={momentum!r}")
        self.offset, self.count = int(offset), int(count)
        self.lr, self.momentum, self.delay = float(lr), float(momentum), int(delay)
        self.buffer = np.zeros(self.count, np.float64)      # B: pushes since the last momentum step
        self.momentum_buffer = np.zeros(self.count, np.float32)
        self.pending = 0                                     # pushes in B
        self.step_count = 0                                  # momentum steps taken

    def step(self, params: np.ndarray, grads: np.ndarray, pushes: int = 1) -> None:
        """Apply `pushes` outer gradients whose sum is grads to params (in place)."""
        # 1. every push at once, with weight 1 / N
        params -= (self.lr / self.delay) * grads
        if self.momentum == 0:
            return
        self.buffer += grads
        self.pending += int(pushes)
        # 2. the momentum step, once N pushes are buffered
        if self.pending >= self.delay:
            m = self.momentum_buffer
            m *= self.momentum
            m += (self.buffer / self.delay).astype(m.dtype)
            params -= (self.lr * self.momentum) * m
            self.buffer[...] = 0
            self.pending = 0
            self.step_count += 1

    def state_buffers(self) -> dict:
        """The checkpointed state, named as SGD's: the outer momentum."""
        return {"momentum_buffer": self.momentum_buffer} if self.momentum > 0 else {}
