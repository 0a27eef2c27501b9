"""PowerSGD: rank-r approximation of each layer's gradient matrix (Vogels et al. 2019),
one power iteration per step from the previous step's Q (warm start), error feedback.

Each segment of the flat layout with 2+ dimensions is a matrix M (shape[0] x the rest);
where r (rows + cols) < rows * cols it is compressed, otherwise (biases, tiny layers) it
goes dense. Across ranks, with a shared Q:
  Step I:   P_i = M_i Q;          P = sum_i P_i        (allreduce, with the dense segments)
  Step II:  P^ = orthonormal basis of P (reduced QR)
  Step III: Q_i = M_i^T P^;       Q = sum_i Q_i        (allreduce)
  result:   sum_i M_i ~ P^ Q^T,   next step's Q <- Q
Rank i's own compression is C_i(M_i) = P^ Q_i^T (so sum_i C_i = P^ Q^T): what compress()
alone keeps. In the allreduce each rank keeps M_i - P^ Q^T / ranks, its share of what the sum
dropped (the authors' code does the same): summed over ranks, exactly what was not sent.
Matrix products are BLAS (NumPy / CuPy matmul): a hand-written kernel would be slower.
factors="float16" sends P and Q as float16 (a power-of-two scale per chunk, summed in
float32): half the bytes of a step; every rank rounds alike, and with error feedback the
rounding joins the residual like the rest of what the sum dropped. The compressed
allreduce's warm-up steps then cross as float16 too (no residual: rounded, not fed back).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpidist.compress.base import Compressor
from mpidist.compress.codecs import CompressorCodec
from mpidist.compress.fp16 import FP16
from mpidist.kernels.backend import get_array_module, to_numpy

__all__ = ["PowerSGD", "Plan", "orthonormalize"]

_PIECE = 1 << 16      # elements per pass of the residual update
_FACTORS = ("float32", "float16")


@dataclass(frozen=True)
class Plan:
    """Which segments are compressed as matrices and where their P, Q live in flat buffers."""
    n: int
    matrices: tuple      # (offset, rows, cols, p_offset, q_offset)
    dense: tuple         # (offset, size)
    p_size: int          # total elements of all P (rows x r) plus dense values
    q_size: int          # total elements of all Q (cols x r)

    def describe(self) -> str:
        sent = self.p_size + self.q_size
        return (f"{len(self.matrices)} matrices at rank-r, {len(self.dense)} dense segments; "
                f"{sent} of {self.n} floats sent ({sent / max(self.n, 1):.4f}x)")


def make_plan(shapes, rank: int) -> Plan:
    """Plan for [(offset, shape)] of a flat buffer."""
    matrices, dense, p, q, n = [], [], 0, 0, 0
    for offset, shape in shapes:
        size = int(np.prod(shape, dtype=np.int64))
        n = max(n, offset + size)
        if len(shape) >= 2 and size:
            rows, cols = int(shape[0]), size // int(shape[0])
            if rank * (rows + cols) < rows * cols:
                matrices.append((offset, rows, cols, p, q))
                p += rows * rank
                q += cols * rank
                continue
        if size:
            dense.append((offset, size))
    dense_total = sum(s for _, s in dense)
    return Plan(n, tuple(matrices), tuple(dense), p + dense_total, q)


def orthonormalize(p, plan: Plan, r: int, xp) -> None:
    """Each matrix's block of P (rows x r) replaced by an orthonormal basis of its columns.

    On the CPU by CholeskyQR2, the blocks of equal shape batched: twice P <- P L^-T with
    L L^T = P^T P (the r x r Gram matrix in float64), which is orthonormal to float32's
    precision for condition numbers far beyond what a power step leaves, at a fraction of
    LAPACK's Householder QR for tall thin blocks; blocks whose Gram matrix is singular (a
    zero gradient) fall back to that QR. On the GPU, CuPy's QR block by block."""
    if xp is not np:
        for _, rows, _, po, _ in plan.matrices:
            block = p[po:po + rows * r].reshape(rows, r)
            block[...] = xp.linalg.qr(block)[0]
        return
    by_rows: dict = {}
    for _, rows, _, po, _ in plan.matrices:
        by_rows.setdefault(rows, []).append(po)
    for rows, starts in by_rows.items():
        blocks = np.stack([p[po:po + rows * r].reshape(rows, r) for po in starts])
        try:
            basis = blocks
            for _ in range(2):
                wide = basis.astype(np.float64)
                inv = np.linalg.inv(np.linalg.cholesky(np.swapaxes(wide, 1, 2) @ wide))
                basis = basis @ np.swapaxes(inv, 1, 2).astype(np.float32)
        except np.linalg.LinAlgError:
            basis = np.linalg.qr(blocks)[0]
        for po, block in zip(starts, basis):
            p[po:po + rows * r] = block.ravel()


class PowerSGD(Compressor):
    """Rank-`rank` PowerSGD over the layout's matrices, error feedback on by default."""
    name = "powersgd"
    aggregation = "linear"
    decodes_alone = False    # the factors are summed over ranks before they decode

    def __init__(self, rank: int = 4, *, factors: str = "float32", error_feedback: bool = True,
                 seed: int = 0):
        super().__init__(error_feedback=error_feedback, seed=seed)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise TypeError(f"PowerSGD rank must be an int, got {type(rank).__name__}")
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1 (e.g. 1, 2, 4), got {rank}")
        if factors not in _FACTORS:
            raise ValueError(f"PowerSGD factors must be one of {', '.join(_FACTORS)} (the "
                             f"dtype P and Q cross the network in), got {factors!r}")
        self.rank, self.factors = int(rank), factors
        # how the compressed allreduce's ring carries the sums of P and Q (None: as they are)
        self.sum_codec = None if factors == "float32" else CompressorCodec(FP16(), None)
        self.q = None          # flat warm-start Q of all matrices (same on every rank)
        self.plan = None

    def config(self) -> dict:
        cfg = {**super().config(), "rank": self.rank}
        if self.factors != "float32":   # absent at the default: older checkpoints still load
            cfg["factors"] = self.factors
        return cfg

    def plan_for(self, layout, n: int) -> Plan:
        """The plan of a layout of n elements (its matrices are what PowerSGD compresses)."""
        if layout is None:
            raise ValueError("PowerSGD needs the layout of the gradient to find its matrices: "
                             "pass layout= (a flat vector alone has none)")
        if layout.numel != n:
            raise ValueError(f"layout has {layout.numel} elements, gradient {n}")
        return make_plan([(s.offset, s.shape) for s in layout.segments], self.rank)

    def _warm_q(self, plan: Plan, xp):
        """Last step's Q (or a checkpointed one); a fresh start for a new plan."""
        if self.q is None or self.q.size != plan.q_size or self.plan not in (None, plan):
            # the same start on every rank: drawn from the seed only
            self.q = np.random.default_rng(self.seed).standard_normal(plan.q_size)
        self.plan = plan
        self.q = xp.asarray(self.q, dtype=np.float32)
        return self.q

    def _power(self, x, layout, allreduce_sum):
        """(payload, ctx): Steps I-III on x, the factors summed by allreduce_sum; None: this
        rank's own payload (P^ and Q_i, the dense segments as they are)."""
        xp = get_array_module(x)
        plan = self.plan_for(layout, x.shape[0])
        r = self.rank
        q = self._warm_q(plan, xp)
        # Step I: P_i = M_i Q, dense segments appended, then summed over ranks
        p = xp.empty(plan.p_size, dtype=np.float32)
        for off, rows, cols, po, qo in plan.matrices:
            m = x[off:off + rows * cols].reshape(rows, cols)
            xp.matmul(m, q[qo:qo + cols * r].reshape(cols, r),
                      out=p[po:po + rows * r].reshape(rows, r))
        ndense = sum(s for _, s in plan.dense)
        d = plan.p_size - ndense
        for off, size in plan.dense:
            p[d:d + size] = x[off:off + size]
            d += size
        if allreduce_sum is not None:
            p = allreduce_sum(p)
        # Step II: orthonormal P^ per matrix
        orthonormalize(p, plan, r, xp)
        # Step III: Q_i = M_i^T P^, summed over ranks
        qi = xp.empty(plan.q_size, dtype=np.float32)
        for off, rows, cols, po, qo in plan.matrices:
            m = x[off:off + rows * cols].reshape(rows, cols)
            xp.matmul(m.T, p[po:po + rows * r].reshape(rows, r),
                      out=qi[qo:qo + cols * r].reshape(cols, r))
        qsum = qi if allreduce_sum is None else allreduce_sum(qi)
        self.q = qsum.copy()
        return (p, qsum), {"n": x.shape[0], "plan": plan}

    def encode(self, x, layout):
        return self._power(x, layout, None)

    def decode_add(self, payload, ctx, out) -> None:
        p, q = payload
        plan = ctx["plan"]
        r = self.rank
        xp = get_array_module(out)
        for off, rows, cols, po, qo in plan.matrices:
            m = out[off:off + rows * cols].reshape(rows, cols)
            m += xp.matmul(p[po:po + rows * r].reshape(rows, r),
                           q[qo:qo + cols * r].reshape(cols, r).T)
        d = plan.p_size - sum(s for _, s in plan.dense)
        for off, size in plan.dense:
            out[off:off + size] += p[d:d + size]
            d += size

    def decompress(self, payload, ctx, out=None, *, into=None):
        """P^ Q^T per matrix and the dense segments, written straight into a new vector or
        `into` (the segments tile it: no zeroing, no temporary per matrix); added into
        out if given."""
        if out is not None:
            return super().decompress(payload, ctx, out)
        p, q = payload
        plan, r = ctx["plan"], self.rank
        xp = get_array_module(p)
        out = xp.empty(ctx["n"], dtype=np.float32) if into is None else into
        for off, rows, cols, po, qo in plan.matrices:
            xp.matmul(p[po:po + rows * r].reshape(rows, r), q[qo:qo + cols * r].reshape(cols, r).T,
                      out=out[off:off + rows * cols].reshape(rows, cols))
        d = plan.p_size - sum(s for _, s in plan.dense)
        for off, size in plan.dense:
            out[off:off + size] = p[d:d + size]
            d += size
        return out

    def reduce(self, x, layout, allreduce_sum, ranks: int = 1, into=None):
        """Sum over `ranks` ranks of C_i(x_i) = P^ Q^T (plus the dense segments summed),
        written into `into` where given (it may be x: x is read only before that).
        x: a flat float32 finite gradient (the compressed allreduce checked it on every rank).

        With error feedback x + e is formed in the residual's own buffer, and each rank
        then keeps x + e less its share of the sum (sum / ranks), as the authors' code and
        torch's hook do. Every product above depends on the inputs only through their sum
        over ranks, and the residuals' sum is the same as with each rank's own C_i, so
        the results are too; no rank needs its own decompression (a full-size product)."""
        if self.error_feedback:
            work = self.residual = self._state_like(self.residual, x)
            work += x
        else:
            work = x
        summed, ctx = self._power(work, layout, allreduce_sum)
        out = self.decompress(summed, ctx, into=into)
        if self.error_feedback:
            share = 1.0 / ranks
            for lo in range(0, out.shape[0], _PIECE):   # the temporaries stay in cache
                work[lo:lo + _PIECE] -= out[lo:lo + _PIECE] * share
        self.step += 1
        return out

    def _extra_state(self) -> dict:
        return {"q": None if self.q is None else to_numpy(self.q).copy()}

    def _load_extra_state(self, sd: dict) -> None:
        self.q = None if sd.get("q") is None else np.asarray(sd["q"], dtype=np.float32).copy()
        self.plan = None
