"""Numba CPU kernels of the optimizers over a flat buffer.

The range an optimizer owns is cut into chunks inside one segment (tensor) each by
`mpidist.optim.plan.Plan` (`lo[c], hi[c]` local bounds, `seg[c]` the segment); a `prange`
over chunks balances the threads. Storage and element arithmetic are float32, as in
PyTorch, with the float64 hyperparameters rounded to float32 once and no fused
multiply-add, so the NumPy reference (mpidist.optim.reference) gives the same bits; sums of
squares accumulate in float64 over LANES interleaved partial sums (vectorised, in a fixed
order). Each update is one fused pass; reductions are per chunk, summed per segment by the
caller. Options are arguments, not specialisations. See docs/ARCHITECTURE.md (optimizers).
"""
import numba
import numpy as np
from numba import njit, prange

__all__ = ["CPUKernels", "sumsq_pg", "lamb_sums", "momentum_update",
           "adam_update", "segment_totals", "onebit_momentum", "onebit_adam_update",
           "onebit_lamb_sums", "onebit_lamb_update"]

_EXP = np.uint32(0x7F800000)  # float32 exponent bits: all ones <=> Inf or NaN
# Below this many elements a kernel runs on the calling thread: waking the thread pool
# costs more than the work (milliseconds when the cores are busy).
PARALLEL_MIN = 1 << 16
BLOCK = 512        # LAMB phase 1: elements whose update direction is staged in L1
LANES = 256        # independent float64 partial sums per sum of squares
f32 = np.float32
# error_model="numpy": a float division is plain IEEE (no zero test per element), which
# with 0-based loops over per-chunk views lets LLVM vectorise the sqrt and divisions.
_OPTS = dict(fastmath=False, error_model="numpy", cache=True)


@njit(parallel=True, **_OPTS)
def _max_exponent(u, lo, hi, out):
    """out[c] = the largest exponent field over chunk c of the float32 bits u: all ones
    means an Inf or NaN there (an integer max, which vectorises unlike a float test)."""
    for c in prange(lo.shape[0]):
        uw = u[lo[c]:hi[c]]
        e = np.uint32(0)
        for i in range(uw.shape[0]):
            e = max(e, uw[i] & _EXP)
        out[c] = e


@njit(**_OPTS)
def _sumsq_into(acc, x, s):
    """acc[k] += float64(x[j*LANES + k] * s)^2 over all rows j: LANES independent float64
    sums in a fixed order (no reassociation), which LLVM vectorises across k."""
    n = x.shape[0]
    for a in range(0, n, LANES):
        row = x[a:min(a + LANES, n)]
        for k in range(row.shape[0]):
            y = np.float64(row[k] * s)
            acc[k] += y * y


@njit(parallel=True, **_OPTS)
def sumsq_pg(p, g, gscale, lo, hi, out):
    """LARS norms, per chunk: out[c] = (sum w^2, sum (gscale*g)^2), float64."""
    gs = f32(gscale)
    for c in prange(lo.shape[0]):
        acc = np.zeros((2, LANES))
        _sumsq_into(acc[0], p[lo[c]:hi[c]], f32(1.0))
        _sumsq_into(acc[1], g[lo[c]:hi[c]], gs)
        out[c, 0] = acc[0].sum()
        out[c, 1] = acc[1].sum()


@njit(**_OPTS)
def _adam_dir(d, m, v, vmax, B1, C1, B2, C2, D1, D2, E):
    """One element of Adam in float32 (written once, used by both Adam kernels):
        m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g^2 ;  vm = max(vmax, v)
        r = (m/bc1) / (sqrt(vm/bc2) + eps)
    Without amsgrad the caller passes vmax = 0, so vm = v (v >= 0)."""
    m1 = B1 * m + C1 * d
    v1 = B2 * v + C2 * (d * d)
    vm = max(vmax, v1)
    return m1, v1, vm, (m1 / D1) / (np.sqrt(vm / D2) + E)


@njit(**_OPTS)
def _adam_consts(gscale, b1, b2, eps, bc1, bc2):
    """The float32 coefficients of _adam_dir, rounded once from the float64 arguments."""
    return (f32(gscale), f32(b1), f32(1.0 - b1), f32(b2), f32(1.0 - b2), f32(bc1), f32(bc2),
            f32(eps))


@njit(parallel=True, **_OPTS)
def lamb_sums(p, g, m, v, vmax, lo, hi, seg, seg_wd, gscale, b1, b2, eps, bc1, bc2, amsgrad,
              out):
    """LAMB phase 1 (reads only), per chunk: out[c] = (sum w^2, sum u^2, sum g^2) with
        u = r + wd_s*w, r the Adam direction of _adam_dir from the moments after this step.
    Phase 2 (adam_update) recomputes r from the same inputs, so no scratch buffer is needed:
    u is staged BLOCK elements at a time (vectorised), then summed in float64."""
    gs, B1, C1, B2, C2, D1, D2, E = _adam_consts(gscale, b1, b2, eps, bc1, bc2)
    for c in prange(lo.shape[0]):
        wd = seg_wd[seg[c]]
        u = np.empty(BLOCK, np.float32)
        acc = np.zeros((3, LANES))
        for a in range(lo[c], hi[c], BLOCK):
            b = min(a + BLOCK, hi[c])
            pw, gw, mw, vw = p[a:b], g[a:b], m[a:b], v[a:b]
            if amsgrad:
                xw = vmax[a:b]
                for i in range(b - a):
                    _, _, _, r = _adam_dir(gw[i] * gs, mw[i], vw[i], xw[i], B1, C1, B2, C2, D1,
                                           D2, E)
                    u[i] = r + wd * pw[i]
            else:
                for i in range(b - a):
                    _, _, _, r = _adam_dir(gw[i] * gs, mw[i], vw[i], f32(0.0), B1, C1, B2, C2,
                                           D1, D2, E)
                    u[i] = r + wd * pw[i]
            _sumsq_into(acc[0], pw, f32(1.0))
            _sumsq_into(acc[1], u[:b - a], f32(1.0))
            _sumsq_into(acc[2], gw, gs)
        for k in range(3):
            out[c, k] = acc[k].sum()


@njit(parallel=True, **_OPTS)
def adam_update(p, g, m, v, vmax, lo, hi, seg, seg_wd, seg_c, gscale, b1, b2, eps, bc1, bc2,
                amsgrad):
    """AdamW, and LAMB phase 2, in one pass:
        (m, v, vmax, r) = _adam_dir(gscale*g, ...)
        w -= c_s * (r + wd_s*w)       AdamW: c_s = lr (= decoupled decay w -= lr*wd*w);
                                      LAMB:  c_s = lr * trust_s
    """
    gs, B1, C1, B2, C2, D1, D2, E = _adam_consts(gscale, b1, b2, eps, bc1, bc2)
    for c in prange(lo.shape[0]):
        a, b = lo[c], hi[c]
        wd, cs = seg_wd[seg[c]], seg_c[seg[c]]
        pw, gw, mw, vw = p[a:b], g[a:b], m[a:b], v[a:b]
        if amsgrad:
            xw = vmax[a:b]
            for i in range(b - a):
                w = pw[i]
                m1, v1, vm, r = _adam_dir(gw[i] * gs, mw[i], vw[i], xw[i], B1, C1, B2, C2, D1,
                                          D2, E)
                mw[i] = m1
                vw[i] = v1
                xw[i] = vm
                pw[i] = w - cs * (r + wd * w)
        else:
            for i in range(b - a):
                w = pw[i]
                m1, v1, _, r = _adam_dir(gw[i] * gs, mw[i], vw[i], f32(0.0), B1, C1, B2, C2, D1,
                                         D2, E)
                mw[i] = m1
                vw[i] = v1
                pw[i] = w - cs * (r + wd * w)


@njit(parallel=True, **_OPTS)
def momentum_update(p, g, buf, lo, hi, seg, seg_wd, seg_c, gscale, decay, mom, lr, nesterov,
                    use_buf):
    """SGD (PyTorch's rule) and LARS (You et al. 2017) in one pass, float32:
        d = gscale*g + wd_s*w
        buf = decay*buf + c_s*d                      (decay = 0 on SGD's first step)
        w -= lr * (d + mom*buf if nesterov else buf)
        without a buffer (use_buf False):  w -= lr * (c_s*d)
    SGD: c_s = 1 - dampening (1 on the first step), lr = lr.
    LARS: c_s = lr * trust_s, lr = 1 (the learning rate lives inside the momentum).
    """
    gs, dec, mo, lr32 = f32(gscale), f32(decay), f32(mom), f32(lr)
    for c in prange(lo.shape[0]):
        a, b = lo[c], hi[c]
        wd, cs = seg_wd[seg[c]], seg_c[seg[c]]
        pw, gw = p[a:b], g[a:b]
        if not use_buf:
            for i in range(b - a):
                w = pw[i]
                pw[i] = w - lr32 * (cs * (gw[i] * gs + wd * w))
            continue
        bw = buf[a:b]
        if nesterov:
            for i in range(b - a):
                w = pw[i]
                d = gw[i] * gs + wd * w
                bb = dec * bw[i] + cs * d
                bw[i] = bb
                pw[i] = w - lr32 * (d + mo * bb)
        else:
            for i in range(b - a):
                w = pw[i]
                bb = dec * bw[i] + cs * (gw[i] * gs + wd * w)
                bw[i] = bb
                pw[i] = w - lr32 * bb


# ------------------------------------------------------------ 1-bit Adam / 1-bit LAMB
ELEMS = 1 << 15    # elements per work item of the segment-free local momentum


@njit(parallel=True, **_OPTS)
def onebit_momentum(m, g, den, b1, mult):
    """The local momentum of the compression stage in the frozen variance's scale, in place
    over g (float32):
        g = (b1*m + (1-b1)*(mult*g)) / den      (0 where den = 0)
    m: the momentum every rank shares (the last exchange's), g: this rank's gradient, den:
    the frozen denominator (or ones, for the momentum as it is)."""
    B1, C1, M = f32(b1), f32(1.0 - b1), f32(mult)
    n = g.shape[0]
    for c in prange((n + ELEMS - 1) // ELEMS):
        a, b = c * ELEMS, min(n, (c + 1) * ELEMS)
        mw, gw, dw = m[a:b], g[a:b], den[a:b]
        for i in range(b - a):
            d = dw[i]
            gw[i] = (B1 * mw[i] + C1 * (M * gw[i])) / d if d > 0 else f32(0.0)


@njit(parallel=True, **_OPTS)
def onebit_adam_update(p, m, v, mstate, lo, hi, seg, seg_wd, seg_c, bc1, bc2, eps):
    """1-bit Adam after the warm-up, one pass (v frozen, m the exchanged momentum):
        r = (m/bc1) / (sqrt(v/bc2) + eps)   (0 where v = 0) ;  w -= c_s * (r + wd_s*w)
        mstate = m
    bc2 is the frozen variance's correction, 1 - b2^freeze_step. Where v = 0 no gradient
    was ever seen (an input that is always 0): there the compressed momentum is only
    compression noise (signs cannot say 0), and divided by eps it would be a huge step."""
    D1, D2, E = f32(bc1), f32(bc2), f32(eps)
    for c in prange(lo.shape[0]):
        a, b = lo[c], hi[c]
        wd, cs = seg_wd[seg[c]], seg_c[seg[c]]
        pw, mw, vw, sw = p[a:b], m[a:b], v[a:b], mstate[a:b]
        for i in range(b - a):
            w = pw[i]
            mi = mw[i]
            vi = vw[i]
            r = (mi / D1) / (np.sqrt(vi / D2) + E) if vi > 0 else f32(0.0)
            sw[i] = mi
            pw[i] = w - cs * (r + wd * w)


@njit(**_OPTS)
def _onebit_lamb_dir(w, m, m_old, v, vf, B1, C1, B2, C2, D1, D2, D2F, E, wd):
    """One element of 1-bit LAMB's compression stage (float32; written once):
        g   = (m - b1*m_old) / (1-b1)                   the gradient the momentum implies
        vf  = b2*vf + (1-b2)*g^2                        the fresh variance goes on
        den = sqrt(v/bc2_frozen) + eps ;  r = (m/bc1) / den  (0 where v = 0: see
        onebit_adam_update) ;  u = r + wd_s*w
        ratio = den / (sqrt(vf/bc2) + eps)              frozen over fresh denominator"""
    g = (m - B1 * m_old) / C1
    vf1 = B2 * vf + C2 * (g * g)
    den = np.sqrt(v / D2) + E
    r = (m / D1) / den if v > 0 else f32(0.0)
    return vf1, r, r + wd * w, den / (np.sqrt(vf1 / D2F) + E)


@njit(**_OPTS)
def _onebit_lamb_consts(b1, b2, eps, bc1, bc2, bc2f):
    return (f32(b1), f32(1.0 - b1), f32(b2), f32(1.0 - b2), f32(bc1), f32(bc2), f32(bc2f),
            f32(eps))


@njit(parallel=True, **_OPTS)
def onebit_lamb_sums(p, m, m_old, v, vf, lo, hi, seg, seg_wd, b1, b2, eps, bc1, bc2, bc2f,
                     out):
    """1-bit LAMB phase 1 (reads only), per chunk: out[c] = (sum w^2, sum u^2, sum r^2,
    max ratio), from _onebit_lamb_dir; bc2 = 1 - b2^freeze_step, bc2f = 1 - b2^t."""
    B1, C1, B2, C2, D1, D2, D2F, E = _onebit_lamb_consts(b1, b2, eps, bc1, bc2, bc2f)
    for c in prange(lo.shape[0]):
        wd = seg_wd[seg[c]]
        u = np.empty(BLOCK, np.float32)
        r = np.empty(BLOCK, np.float32)
        acc = np.zeros((3, LANES))
        top = f32(0.0)
        for a in range(lo[c], hi[c], BLOCK):
            b = min(a + BLOCK, hi[c])
            pw, mw, ow, vw, fw = p[a:b], m[a:b], m_old[a:b], v[a:b], vf[a:b]
            for i in range(b - a):
                _, ri, ui, q = _onebit_lamb_dir(pw[i], mw[i], ow[i], vw[i], fw[i], B1, C1, B2,
                                                C2, D1, D2, D2F, E, wd)
                r[i] = ri
                u[i] = ui
                top = max(top, q)
            _sumsq_into(acc[0], pw, f32(1.0))
            _sumsq_into(acc[1], u[:b - a], f32(1.0))
            _sumsq_into(acc[2], r[:b - a], f32(1.0))
        for k in range(3):
            out[c, k] = acc[k].sum()
        out[c, 3] = top


@njit(parallel=True, **_OPTS)
def onebit_lamb_update(p, m, m_old, v, vf, lo, hi, seg, seg_wd, seg_c, b1, b2, eps, bc1, bc2,
                       bc2f):
    """1-bit LAMB phase 2, one pass: (vf, r, u) from _onebit_lamb_dir; w -= c_s*u with
    c_s = lr * coefficient_s; m_old = m (the momentum this step leaves)."""
    B1, C1, B2, C2, D1, D2, D2F, E = _onebit_lamb_consts(b1, b2, eps, bc1, bc2, bc2f)
    for c in prange(lo.shape[0]):
        a, b = lo[c], hi[c]
        wd, cs = seg_wd[seg[c]], seg_c[seg[c]]
        pw, mw, ow, vw, fw = p[a:b], m[a:b], m_old[a:b], v[a:b], vf[a:b]
        for i in range(b - a):
            w = pw[i]
            vf1, _, ui, _ = _onebit_lamb_dir(w, mw[i], ow[i], vw[i], fw[i], B1, C1, B2, C2, D1,
                                            D2, D2F, E, wd)
            fw[i] = vf1
            ow[i] = mw[i]
            pw[i] = w - cs * ui


def segment_max(partials, seg, nseg):
    """Per-segment maximum of per-chunk values (nchunk,) -> (nseg,), float64 (0 if none)."""
    out = np.zeros(nseg, np.float64)
    np.maximum.at(out, seg, partials)
    return out


def segment_totals(partials, seg, nseg):
    """Sum per-chunk partials (nchunk, k) into per-segment totals (nseg, k), float64."""
    out = np.zeros((nseg, partials.shape[1]), np.float64)
    np.add.at(out, seg, partials)
    return out


def _f32(x):
    return np.ascontiguousarray(x, dtype=np.float32)


class CPUKernels:
    """The kernels bound to one optimizer's Plan (chunks), with the interface that
    mpidist.optim calls on every backend. Per-segment arrays (one entry per layout segment)
    come as float64 and are rounded to float32 here; sums come back as float64 (nseg, k)."""

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
        """Whether every element of g is finite."""
        out = np.empty(self.lo.shape[0], np.uint32)
        self._run(_max_exponent, g.view(np.uint32), self.lo, self.hi, out)
        return bool(np.all(out != _EXP))

    def sumsq_pg(self, p, g, gscale):
        """(nseg, 2) float64: sums of w^2 and (gscale*g)^2 per segment (LARS's norms)."""
        out = np.empty((self.lo.shape[0], 2), np.float64)
        self._run(sumsq_pg, p, g, gscale, self.lo, self.hi, out)
        return segment_totals(out, self.seg, self.nseg)

    def lamb_sums(self, p, g, m, v, vmax, seg_wd, gscale, b1, b2, eps, bc1, bc2, amsgrad):
        """LAMB phase 1, reads only: (nseg, 3) float64 sums of w^2, u^2, (gscale*g)^2."""
        out = np.empty((self.lo.shape[0], 3), np.float64)
        self._run(lamb_sums, p, g, m, v, vmax, self.lo, self.hi, self.seg, _f32(seg_wd), gscale,
                  b1, b2, eps, bc1, bc2, amsgrad, out)
        return segment_totals(out, self.seg, self.nseg)

    def adam_update(self, p, g, m, v, vmax, seg_wd, seg_c, gscale, b1, b2, eps, bc1, bc2,
                    amsgrad):
        """Fused AdamW / LAMB phase 2: m, v (and vmax with amsgrad) updated, w -= c_s * (r + wd_s w)."""
        self._run(adam_update, p, g, m, v, vmax, self.lo, self.hi, self.seg, _f32(seg_wd),
                  _f32(seg_c), gscale, b1, b2, eps, bc1, bc2, amsgrad)

    def momentum_update(self, p, g, buf, seg_wd, seg_c, gscale, decay, mom, lr, nesterov,
                        use_buf):
        """Fused SGD / LARS step (the formula is the module function momentum_update's)."""
        self._run(momentum_update, p, g, buf, self.lo, self.hi, self.seg, _f32(seg_wd),
                  _f32(seg_c), gscale, decay, mom, lr, nesterov, use_buf)

    def onebit_momentum(self, m, g, den, b1, mult):
        """1-bit local momentum into g: (b1 m + (1 - b1) mult g) / den (0 where den = 0)."""
        n = int(g.shape[0])
        if n < PARALLEL_MIN:
            threads = numba.get_num_threads()
            numba.set_num_threads(1)
            try:
                onebit_momentum(m, g, den, b1, mult)
            finally:
                numba.set_num_threads(threads)
        else:
            onebit_momentum(m, g, den, b1, mult)

    def onebit_adam_update(self, p, m, v, mstate, seg_wd, seg_c, bc1, bc2, eps):
        """1-bit Adam after the freeze: w -= c_s (r + wd_s w), r over the frozen variance; mstate = m."""
        self._run(onebit_adam_update, p, m, v, mstate, self.lo, self.hi, self.seg,
                  _f32(seg_wd), _f32(seg_c), bc1, bc2, eps)

    def onebit_lamb_sums(self, p, m, m_old, v, vf, seg_wd, b1, b2, eps, bc1, bc2, bc2f):
        """(nseg, 4) float64: sums of w^2, u^2, r^2 and the max ratio per segment."""
        out = np.empty((self.lo.shape[0], 4), np.float64)
        self._run(onebit_lamb_sums, p, m, m_old, v, vf, self.lo, self.hi, self.seg,
                  _f32(seg_wd), b1, b2, eps, bc1, bc2, bc2f, out)
        tot = segment_totals(out[:, :3], self.seg, self.nseg)
        return np.concatenate([tot, segment_max(out[:, 3], self.seg, self.nseg)[:, None]], 1)

    def onebit_lamb_update(self, p, m, m_old, v, vf, seg_wd, seg_c, b1, b2, eps, bc1, bc2,
                           bc2f):
        """1-bit LAMB phase 2: the fresh variance vf updated, w -= c_s u; m_old = m."""
        self._run(onebit_lamb_update, p, m, m_old, v, vf, self.lo, self.hi, self.seg,
                  _f32(seg_wd), _f32(seg_c), b1, b2, eps, bc1, bc2, bc2f)
