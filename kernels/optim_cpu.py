"""Numba CPU kernels of the optimizers over a flat buffer.

The range an optimizer owns is cut into chunks, each inside one segment (tensor), by
`mpidist.optim.base.Plan`: `lo[c], hi[c]` are local element bounds and `seg[c]` the
layout's segment index. A `prange` over chunks balances the threads, and each chunk reads its
segment's coefficients (weight decay `seg_wd`, step factor `seg_c`) once.

Storage is float32; arithmetic is float64 per element (so the NumPy reference in
mpidist.optim.reference gives the same numbers). Each update is one fused pass over memory;
reductions (finite check, sums of squares) are per chunk, summed per segment by the caller.
Five kernels serve the four optimizers: options are arguments, not specialisations, so a
new process loads five cached functions (`cache=True`) and compiles nothing.
"""
import numba
import numpy as np
from numba import njit, prange

__all__ = ["CPUKernels", "sumsq_pg", "lamb_sums", "momentum_update",
           "adam_update", "segment_totals"]

_EXP = np.uint32(0x7F800000)  # float32 exponent bits: all ones <=> Inf or NaN
# Below this many elements a kernel runs on the calling thread: waking the thread pool
# costs more than the work (milliseconds when the cores are busy).
PARALLEL_MIN = 1 << 16


@njit(parallel=True, fastmath=False, cache=True)
def _max_exponent(u, lo, hi, out):
    """out[c] = the largest exponent field over chunk c of the float32 bits u: all ones
    means an Inf or NaN there (an integer max, which vectorises unlike a float test)."""
    for c in prange(lo.shape[0]):
        e = np.uint32(0)
        for i in range(lo[c], hi[c]):
            e = max(e, u[i] & _EXP)
        out[c] = e


@njit(parallel=True, fastmath=False, cache=True)
def sumsq_pg(p, g, gscale, lo, hi, out):
    """LARS norms, per chunk: out[c] = (sum w^2, sum (gscale*g)^2), float64.

    Eight independent accumulators per quantity keep the (strict, unfused) float64 sums
    from being one serial dependency chain.
    """
    for c in prange(lo.shape[0]):
        a, b = lo[c], hi[c]
        w0 = w1 = w2 = w3 = w4 = w5 = w6 = w7 = 0.0
        g0 = g1 = g2 = g3 = g4 = g5 = g6 = g7 = 0.0
        stop8 = a + (b - a) // 8 * 8
        for i in range(a, stop8, 8):
            x0 = np.float64(p[i]); x1 = np.float64(p[i + 1])
            x2 = np.float64(p[i + 2]); x3 = np.float64(p[i + 3])
            x4 = np.float64(p[i + 4]); x5 = np.float64(p[i + 5])
            x6 = np.float64(p[i + 6]); x7 = np.float64(p[i + 7])
            w0 += x0 * x0; w1 += x1 * x1; w2 += x2 * x2; w3 += x3 * x3
            w4 += x4 * x4; w5 += x5 * x5; w6 += x6 * x6; w7 += x7 * x7
            y0 = np.float64(g[i]) * gscale; y1 = np.float64(g[i + 1]) * gscale
            y2 = np.float64(g[i + 2]) * gscale; y3 = np.float64(g[i + 3]) * gscale
            y4 = np.float64(g[i + 4]) * gscale; y5 = np.float64(g[i + 5]) * gscale
            y6 = np.float64(g[i + 6]) * gscale; y7 = np.float64(g[i + 7]) * gscale
            g0 += y0 * y0; g1 += y1 * y1; g2 += y2 * y2; g3 += y3 * y3
            g4 += y4 * y4; g5 += y5 * y5; g6 += y6 * y6; g7 += y7 * y7
        for i in range(stop8, b):
            x0 = np.float64(p[i])
            w0 += x0 * x0
            y0 = np.float64(g[i]) * gscale
            g0 += y0 * y0
        out[c, 0] = ((w0 + w1) + (w2 + w3)) + ((w4 + w5) + (w6 + w7))
        out[c, 1] = ((g0 + g1) + (g2 + g3)) + ((g4 + g5) + (g6 + g7))


@njit(fastmath=False, cache=True)
def _adam_dir(g, m, v, vmax, b1, b2, eps, bc1, bc2, amsgrad):
    """One element of Adam, float64 in and out (written once, used by both Adam kernels):
        m = b1*m + (1-b1)*g ; v = b2*v + (1-b2)*g^2 ; vmax = max(vmax, v) (amsgrad)
        r = (m/bc1) / (sqrt(v/bc2) + eps)         (v -> vmax with amsgrad)
    """
    m1 = b1 * m + (1.0 - b1) * g
    v1 = b2 * v + (1.0 - b2) * (g * g)
    vm = max(vmax, v1) if amsgrad else v1
    r = (m1 / bc1) / (np.sqrt(vm / bc2) + eps)
    return m1, v1, vm, r


@njit(parallel=True, fastmath=False, cache=True)
def lamb_sums(p, g, m, v, vmax, lo, hi, seg, seg_wd, gscale, b1, b2, eps, bc1, bc2, amsgrad,
              out):
    """LAMB phase 1 (reads only), per chunk: out[c] = (sum w^2, sum u^2, sum g^2) with
        u = r + wd_s*w, r the Adam direction of _adam_dir from the moments after this step.
    Phase 2 (adam_update) recomputes r from the same inputs, so no scratch buffer is needed.
    """
    for c in prange(lo.shape[0]):
        wd = seg_wd[seg[c]]
        sw0 = sw1 = su0 = su1 = sg0 = sg1 = 0.0
        a, b = lo[c], hi[c]
        stop2 = a + (b - a) // 2 * 2
        for i in range(a, stop2, 2):
            w = np.float64(p[i]); d = np.float64(g[i]) * gscale
            vm = np.float64(vmax[i]) if amsgrad else 0.0
            _, _, _, r = _adam_dir(d, np.float64(m[i]), np.float64(v[i]), vm,
                                   b1, b2, eps, bc1, bc2, amsgrad)
            u = r + wd * w
            sw0 += w * w; su0 += u * u; sg0 += d * d
            w = np.float64(p[i + 1]); d = np.float64(g[i + 1]) * gscale
            vm = np.float64(vmax[i + 1]) if amsgrad else 0.0
            _, _, _, r = _adam_dir(d, np.float64(m[i + 1]), np.float64(v[i + 1]), vm,
                                   b1, b2, eps, bc1, bc2, amsgrad)
            u = r + wd * w
            sw1 += w * w; su1 += u * u; sg1 += d * d
        for i in range(stop2, b):
            w = np.float64(p[i]); d = np.float64(g[i]) * gscale
            vm = np.float64(vmax[i]) if amsgrad else 0.0
            _, _, _, r = _adam_dir(d, np.float64(m[i]), np.float64(v[i]), vm,
                                   b1, b2, eps, bc1, bc2, amsgrad)
            u = r + wd * w
            sw0 += w * w; su0 += u * u; sg0 += d * d
        out[c, 0] = sw0 + sw1
        out[c, 1] = su0 + su1
        out[c, 2] = sg0 + sg1


@njit(parallel=True, fastmath=False, cache=True)
def adam_update(p, g, m, v, vmax, lo, hi, seg, seg_wd, seg_c, gscale, b1, b2, eps, bc1, bc2,
                amsgrad):
    """AdamW, and LAMB phase 2, in one pass:
        (m, v, vmax, r) = _adam_dir(gscale*g, ...)
        w -= c_s * (r + wd_s*w)       AdamW: c_s = lr (= decoupled decay w -= lr*wd*w);
                                      LAMB:  c_s = lr * trust_s
    """
    for c in prange(lo.shape[0]):
        s = seg[c]
        wd = seg_wd[s]
        cs = seg_c[s]
        for i in range(lo[c], hi[c]):
            w = np.float64(p[i])
            vm = np.float64(vmax[i]) if amsgrad else 0.0
            m1, v1, vm1, r = _adam_dir(np.float64(g[i]) * gscale, np.float64(m[i]),
                                       np.float64(v[i]), vm, b1, b2, eps, bc1, bc2, amsgrad)
            m[i] = np.float32(m1)
            v[i] = np.float32(v1)
            if amsgrad:
                vmax[i] = np.float32(vm1)
            p[i] = np.float32(w - cs * (r + wd * w))


@njit(parallel=True, fastmath=False, cache=True)
def momentum_update(p, g, buf, lo, hi, seg, seg_wd, seg_c, gscale, decay, mom, lr, nesterov,
                    use_buf):
    """SGD (PyTorch's rule) and LARS (You et al. 2017) in one pass:
        d = gscale*g + wd_s*w
        buf = decay*buf + c_s*d                      (decay = 0 on SGD's first step)
        w -= lr * (d + mom*buf if nesterov else buf)
        without a buffer (use_buf False):  w -= lr * c_s * d
    SGD: c_s = 1 - dampening (1 on the first step), lr = lr.
    LARS: c_s = lr * trust_s, lr = 1 (the learning rate lives inside the momentum).
    """
    for c in prange(lo.shape[0]):
        s = seg[c]
        wd = seg_wd[s]
        cs = seg_c[s]
        if use_buf:
            for i in range(lo[c], hi[c]):
                w = np.float64(p[i])
                d = np.float64(g[i]) * gscale + wd * w
                b = decay * np.float64(buf[i]) + cs * d
                buf[i] = np.float32(b)
                if nesterov:
                    p[i] = np.float32(w - lr * (d + mom * b))
                else:
                    p[i] = np.float32(w - lr * b)
        else:
            for i in range(lo[c], hi[c]):
                w = np.float64(p[i])
                d = np.float64(g[i]) * gscale + wd * w
                p[i] = np.float32(w - lr * (cs * d))


def segment_totals(partials, seg, nseg):
    """Sum per-chunk partials (nchunk, k) into per-segment totals (nseg, k), float64."""
    out = np.zeros((nseg, partials.shape[1]), np.float64)
    np.add.at(out, seg, partials)
    return out


class CPUKernels:
    """The kernels bound to one optimizer's Plan (chunks), with the interface that
    mpidist.optim calls on every backend. Per-segment arrays have one entry per layout
    segment; sums come back as float64 (nseg, k) NumPy arrays."""

    def __init__(self, plan):
        self.lo, self.hi, self.seg, self.nseg = plan.lo, plan.hi, plan.seg, plan.nseg
        self.serial = int(plan.pbounds[-1]) < PARALLEL_MIN

    def _run(self, kernel, *args):
        if not self.serial:
            return kernel(*args)
        threads = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            return kernel(*args)
        finally:
            numba.set_num_threads(threads)

    def all_finite(self, g) -> bool:
        out = np.empty(self.lo.shape[0], np.uint32)
        self._run(_max_exponent, g.view(np.uint32), self.lo, self.hi, out)
        return bool(np.all(out != _EXP))

    def sumsq_pg(self, p, g, gscale):
        out = np.empty((self.lo.shape[0], 2), np.float64)
        self._run(sumsq_pg, p, g, gscale, self.lo, self.hi, out)
        return segment_totals(out, self.seg, self.nseg)

    def lamb_sums(self, p, g, m, v, vmax, seg_wd, gscale, b1, b2, eps, bc1, bc2, amsgrad):
        out = np.empty((self.lo.shape[0], 3), np.float64)
        self._run(lamb_sums, p, g, m, v, vmax, self.lo, self.hi, self.seg, seg_wd, gscale, b1, b2,
                  eps, bc1, bc2, amsgrad, out)
        return segment_totals(out, self.seg, self.nseg)

    def adam_update(self, p, g, m, v, vmax, seg_wd, seg_c, gscale, b1, b2, eps, bc1, bc2,
                    amsgrad):
        self._run(adam_update, p, g, m, v, vmax, self.lo, self.hi, self.seg, seg_wd, seg_c, gscale,
                  b1, b2, eps, bc1, bc2, amsgrad)

    def momentum_update(self, p, g, buf, seg_wd, seg_c, gscale, decay, mom, lr, nesterov,
                        use_buf):
        self._run(momentum_update, p, g, buf, self.lo, self.hi, self.seg, seg_wd, seg_c, gscale,
                  decay, mom, lr, nesterov, use_buf)
