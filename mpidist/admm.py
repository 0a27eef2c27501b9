"""Consensus ADMM (Boyd et al. 2011, "Distributed Optimization and Statistical Learning via
the Alternating Direction Method of Multipliers", sections 3.3, 3.4.1 and 7.1).

    minimize  sum_i f_i(x_i) + g(z)   subject to  x_i = z,   i = 1..N (one block per rank)

Problems: `Lasso` (x-update by a cached Cholesky factor) and `LogisticRegression` (damped
Newton); each rank passes its own rows. `consensus_admm` runs the scaled-form iteration (its
docstring numbers the steps). `ADMMStrategy` (`strategy = "admm"` in a job) runs the same
iteration on a neural network: the x-update is inexact (one optimizer step on the rank's
mini-batch of f_i(x) + rho/2 ||x - z + u_i||^2), g = 0 so z is the mean of x_i + u_i.
See docs/ARCHITECTURE.md (parameter server and ADMM).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import scipy.linalg

from mpidist.collectives import allreduce
from mpidist.comm import as_communicator
from mpidist.errors import ConfigError
from mpidist.nn import SoftmaxCrossEntropy, materialize
from mpidist.state import StateDict, read_params, replicated_pieces
from mpidist.strategy.base import Strategy
from mpidist.strategy.builders import build_model_from_config, build_optimizer_from_config

__all__ = ["Lasso", "LogisticRegression", "ADMMResult", "consensus_admm", "ADMMStrategy",
           "soft_threshold"]


def soft_threshold(v: np.ndarray, k: float) -> np.ndarray:
    """The proximal operator of k ||.||_1."""
    return np.sign(v) * np.maximum(np.abs(v) - k, 0.0)


def _check_rows(A, b, what: str):
    A = np.ascontiguousarray(A, dtype=np.float64)
    b = np.ascontiguousarray(b, dtype=np.float64)
    if A.ndim != 2 or b.shape != (A.shape[0],):
        raise ValueError(f"{what}: A must be 2-D (rows, features) and b 1-D with one entry per "
                         f"row, got A {A.shape} and b {b.shape}")
    return A, b


class Lasso:
    """This rank's block of 1/2 ||A x - b||^2 + lam ||x||_1."""

    def __init__(self, A, b, lam: float):
        self.A, self.b = _check_rows(A, b, "Lasso")
        if not lam >= 0:
            raise ValueError(f"lam must be >= 0, got {lam!r}")
        self.lam = float(lam)
        self.n = self.A.shape[1]
        self._AtA = self.A.T @ self.A
        self._Atb = self.A.T @ self.b
        self._factor = (None, None)            # (rho, Cholesky factor of AtA + rho I)

    def x_update(self, v: np.ndarray, rho: float, x0: np.ndarray) -> np.ndarray:
        """argmin 1/2 ||A x - b||^2 + rho/2 ||x - v||^2 = (AtA + rho I)^-1 (Atb + rho v)."""
        if self._factor[0] != rho:
            self._factor = (rho, scipy.linalg.cho_factor(self._AtA + rho * np.eye(self.n)))
        return scipy.linalg.cho_solve(self._factor[1], self._Atb + rho * v)

    def z_update(self, mean: np.ndarray, rho: float, N: int) -> np.ndarray:
        return soft_threshold(mean, self.lam / (N * rho))

    def objective(self, x: np.ndarray) -> float:
        """This block's share of the loss (the regulariser is counted once, by the caller)."""
        r = self.A @ x - self.b
        return 0.5 * float(r @ r)

    def regularizer(self, z: np.ndarray) -> float:
        return self.lam * float(np.abs(z).sum())


class LogisticRegression:
    """This rank's block of sum log(1 + exp(-y a^T x)) + lam/2 ||x||^2 (labels -1/+1 or 0/1)."""

    def __init__(self, A, y, lam: float, newton_tol: float = 1e-12, newton_iters: int = 50):
        self.A, y = _check_rows(A, y, "LogisticRegression")
        if not set(np.unique(y)) <= {-1.0, 1.0, 0.0}:
            raise ValueError("labels must be -1/+1 or 0/1")
        self.y = np.where(y > 0, 1.0, -1.0)
        if not lam > 0:
            raise ValueError(f"lam must be > 0 (the ridge term makes the optimum unique), got {lam!r}")
        self.lam = float(lam)
        self.n = self.A.shape[1]
        self.newton_tol, self.newton_iters = newton_tol, newton_iters

    def _local(self, x, v, rho):
        m = self.y * (self.A @ x)
        return float(np.logaddexp(0.0, -m).sum()) + 0.5 * rho * float((x - v) @ (x - v))

    def x_update(self, v: np.ndarray, rho: float, x0: np.ndarray) -> np.ndarray:
        """Damped Newton on sum log(1 + exp(-y a^T x)) + rho/2 ||x - v||^2, from x0."""
        x = x0.copy()
        for _ in range(self.newton_iters):
            m = self.y * (self.A @ x)
            p = 0.5 * (1.0 - np.tanh(0.5 * m))           # sigma(-m), stable
            grad = -self.A.T @ (self.y * p) + rho * (x - v)
            H = (self.A.T * (p * (1.0 - p))) @ self.A + rho * np.eye(self.n)
            step = scipy.linalg.solve(H, grad, assume_a="pos")
            decrement = float(grad @ step)
            if decrement / 2 <= self.newton_tol:
                break
            f0, t = self._local(x, v, rho), 1.0
            while self._local(x - t * step, v, rho) > f0 - 0.25 * t * decrement and t > 1e-10:
                t *= 0.5
            x -= t * step
        return x

    def z_update(self, mean: np.ndarray, rho: float, N: int) -> np.ndarray:
        return (N * rho) * mean / (self.lam + N * rho)

    def objective(self, x: np.ndarray) -> float:
        return float(np.logaddexp(0.0, -self.y * (self.A @ x)).sum())

    def regularizer(self, z: np.ndarray) -> float:
        return 0.5 * self.lam * float(z @ z)


@dataclass
class ADMMResult:
    """What consensus_admm returns: z (the same on every rank), iterations, convergence."""
    z: np.ndarray
    iterations: int
    converged: bool
    objective: float
    history: list = field(default_factory=list)   # (r, s, eps_pri, eps_dual, rho) per iteration


def consensus_admm(problem, *, comm=None, rho: float = 1.0, max_iter: int = 2000,
                   abstol: float = 1e-8, reltol: float = 1e-6, adapt_rho: bool = True,
                   mu: float = 10.0, tau: float = 2.0, adapt_iters: int = 200,
                   algorithm: str = "auto") -> ADMMResult:
    """Collective: solve the consensus problem whose block `problem` this rank holds.

    Returns the consensus z (identical on every rank) and the residual history.

    Scaled form, iteration k (one allreduce of n numbers and one of 3 numbers):
      1. x-update (local):  x_i = argmin f_i(x) + rho/2 ||x - z + u_i||^2
      2. z-update (global): z = prox_{g / (N rho)}(mean_i(x_i + u_i))        -- mpidist allreduce
      3. u-update (local):  u_i = u_i + x_i - z
      4. residuals:         r = sqrt(sum_i ||x_i - z||^2),  s = rho sqrt(N) ||z - z_prev||  -- allreduce
         stop when r <= eps_pri = sqrt(N n) abstol + reltol max(||x||, sqrt(N) ||z||)
               and s <= eps_dual = sqrt(N n) abstol + reltol rho ||u||   (stacked norms)
      5. rho adaptation (3.4.1): r > mu s -> rho *= tau, u /= tau;  s > mu r -> rho /= tau, u *= tau
         (only during the first `adapt_iters` iterations, so the fixed-rho convergence proof holds).
    """
    c = as_communicator(comm)
    if not rho > 0 or not mu > 1 or not tau > 1:
        raise ValueError(f"need rho > 0, mu > 1, tau > 1; got rho={rho}, mu={mu}, tau={tau}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive int, got {max_iter!r}")
    n, N = problem.n, c.size
    c.check_same((type(problem).__name__, n, float(problem.lam)), "ADMM problem (type, features, lam)")
    x, u, z = np.zeros(n), np.zeros(n), np.zeros(n)
    history, converged = [], False
    it = 0
    for it in range(1, max_iter + 1):
        # 1. x-update on my block
        x = problem.x_update(z - u, rho, x)
        # 2. z-update: the mean of x_i + u_i over the ranks, then g's proximal step
        total = allreduce(x + u, op="sum", algorithm=algorithm, comm=c)
        z_prev, z = z, problem.z_update(total / N, rho, N)
        # 3. dual update
        u += x - z
        # 4. residuals and tolerances (stacked over the ranks)
        sq = allreduce(np.array([(x - z) @ (x - z), x @ x, u @ u]), op="sum",
                       algorithm=algorithm, comm=c)
        r = float(np.sqrt(sq[0]))
        s = rho * np.sqrt(N) * float(np.linalg.norm(z - z_prev))
        eps_pri = np.sqrt(N * n) * abstol + reltol * max(np.sqrt(sq[1]), np.sqrt(N) * np.linalg.norm(z))
        eps_dual = np.sqrt(N * n) * abstol + reltol * rho * np.sqrt(sq[2])
        history.append((r, s, eps_pri, eps_dual, rho))
        if r <= eps_pri and s <= eps_dual:
            converged = True
            break
        # 5. residual balancing
        if adapt_rho and it <= adapt_iters:
            if r > mu * s:
                rho *= tau
                u /= tau
            elif s > mu * r:
                rho /= tau
                u *= tau
    loss = allreduce(np.array([problem.objective(z)]), op="sum", algorithm=algorithm, comm=c)
    return ADMMResult(z=z, iterations=it, converged=converged,
                      objective=float(loss[0]) + problem.regularizer(z), history=history)


class ADMMStrategy(Strategy):
    """[parallel] strategy = "admm": rho (and algorithm, the allreduce used for z).

    Every rank keeps its own x_i (the model's parameters), u_i and optimizer; the consensus
    z is what `evaluate` and `state_dict` use. One train_step is one ADMM iteration with an
    inexact x-update: one optimizer step on the rank's mini-batch mean loss plus
    rho/2 ||x - z + u_i||^2. A checkpoint holds z and rho; x_i restarts from z, u_i from 0.
    """
    name = "admm"
    keys = ("rho",)
    compresses = accumulates = False
    mu, tau, adapt_iters = 10.0, 2.0, 200

    def __init__(self, config: dict, comm, meta: dict):
        super().__init__(config, comm, meta)
        if meta.get("kind") == "lm":
            raise ConfigError("strategy 'admm' trains classification models (mlp, cnn), not gpt")
        self.model = build_model_from_config(config, meta)
        self.layout, self.params, self.grads = materialize(self.model, dtype=np.float32,
                                                           seed=config["job"]["seed"])
        self.optimizer = build_optimizer_from_config(config, self.layout)
        self.rho = float(config["parallel"]["rho"])
        self.algorithm = config["parallel"]["algorithm"]
        self.z = self.params.data.copy()
        self.u = np.zeros_like(self.z)
        self._z_prev = np.empty_like(self.z)
        self.loss = SoftmaxCrossEntropy()

    def train_step(self, x, y, global_count: int | None = None) -> dict:
        N, w = self.comm.size, self.params.data
        rows = 0 if x is None else len(x)
        t0 = time.perf_counter()
        # 1. x-update: one optimizer step on f_i(x) + rho/2 ||x - z + u_i||^2
        self.grads.data[...] = 0
        loss_sum = correct = 0.0
        if rows:
            loss_sum, correct = self.loss.forward(self.model.forward(x, train=True), y)
            self.model.backward(self.loss.backward(1.0 / rows))
        self.grads.data += self.rho * (w - self.z + self.u)
        t1 = time.perf_counter()
        info = self.optimizer.step(w, self.grads.data)
        t2 = time.perf_counter()
        # 2. z-update: mean of x_i + u_i (g = 0)
        self._z_prev[...] = self.z
        self.z[...] = allreduce(w + self.u, op="sum", algorithm=self.algorithm, comm=self.comm) / N
        # 3. dual update
        self.u += w - self.z
        # 4. residuals, with the step's loss statistics in the same allreduce
        d = (w - self.z).astype(np.float64)
        sums = allreduce(np.array([d @ d, loss_sum, correct, rows], np.float64), op="sum",
                         algorithm=self.algorithm, comm=self.comm)
        r = float(np.sqrt(sums[0]))
        s = self.rho * np.sqrt(N) * float(np.linalg.norm((self.z - self._z_prev).astype(np.float64)))
        # 5. residual balancing while the run is young
        rho = self.rho
        if self.step < self.adapt_iters:
            if r > self.mu * s:
                self.rho *= self.tau
                self.u /= self.tau
            elif s > self.mu * r:
                self.rho /= self.tau
                self.u *= self.tau
        t3 = time.perf_counter()
        self.step += 1
        count = int(sums[3])
        return {"loss": float(sums[1]) / max(count, 1), "correct": int(sums[2]), "count": count,
                "t_compute": t1 - t0, "t_comm": t3 - t2, "t_optim": t2 - t1,
                "lr": info.lr, "rho": rho, "primal_residual": r, "dual_residual": s}

    def evaluate(self, x, y) -> dict:
        """Loss and accuracy of the consensus z (summed over ranks)."""
        loss_sum = correct = 0.0
        count = 0 if x is None else len(x)
        if count:
            saved = self.params.data.copy()
            self.params.data[...] = self.z
            try:
                loss_sum, correct = self.loss.forward(self.model.forward(x, train=False), y)
            finally:
                self.params.data[...] = saved
        totals = self.comm.comm.allreduce(np.array([loss_sum, correct, count], np.float64))
        return {"loss": float(totals[0]), "correct": int(totals[1]), "count": int(totals[2])}

    def state_dict(self) -> StateDict:
        tensors = replicated_pieces("params", self.layout, self.z, self.comm.rank, self.comm.size)
        return StateDict(self.step, tensors, {"rho": self.rho})

    def load_state_dict(self, source) -> None:
        read_params(source, self.layout, self.z)
        self.params.data[...] = self.z
        self.u[...] = 0
        self.rho = float(source.scalars.get("rho", self.rho))
        self.step = int(source.step)

    def memory_report(self) -> dict:
        optim = sum(int(b.nbytes) for b in self.optimizer.state_buffers().values())
        rep = {"params": int(self.params.data.nbytes), "grads": int(self.grads.data.nbytes),
               "optim": optim + int(self.z.nbytes + self.u.nbytes + self._z_prev.nbytes)}
        rep["total"] = sum(rep.values())
        return rep
