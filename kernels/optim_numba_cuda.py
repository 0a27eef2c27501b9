"""The optimizers' GPU kernels in numba.cuda, with the CuPy kernels' contract and interface.

They accept CuPy arrays on a GPU, and NumPy arrays under Numba's CUDA simulator
(NUMBA_ENABLE_CUDASIM=1 before numba is first imported), which is how the CPU test suite
runs them. They compile on first launch.
See docs/ARCHITECTURE.md (kernels).
"""
from __future__ import annotations

import math

import numpy as np
from numba import config as numba_config, cuda, float32, float64

from mpidist.kernels.backend import get_array_module
from mpidist.kernels.optim_cpu import segment_max, segment_totals
from mpidist.kernels.optim_gpu_shared import THREADS, adam_consts, gpu_chunks, onebit_lamb_consts

__all__ = ["NumbaCudaKernels"]

# Scalars arrive as np.float32, so the arithmetic is float32 both compiled (float32 x
# float32) and in the simulator (NumPy scalars); sqrt goes through float64 and is rounded
# back, which equals a correctly rounded float32 sqrt.
# NVVM fuses a*b + c into one fma unless told not to, and cuda.jit has no switch for it
# (fastmath=False still contracts): a product that feeds a sum goes through _mul32/_mul64,
# libdevice's round-to-nearest multiply, which is never fused. The simulator has no
# libdevice, and NumPy never fuses: plain products there.
if numba_config.ENABLE_CUDASIM:
    @cuda.jit(device=True)
    def _mul32(a, b):
        return a * b

    _mul64 = _mul32
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _mul32(a, b):
        return libdevice.fmul_rn(a, b)

    @cuda.jit(device=True)
    def _mul64(a, b):
        return libdevice.dmul_rn(a, b)


@cuda.jit(device=True)
def _cu_piece_of(pb, i):
    lo, hi = 0, pb.shape[0] - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pb[mid] <= i:
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit(device=True)
def _cu_adam_dir(d, m, v, vmax, B1, C1, B2, C2, D1, D2, E):
    # m = b1*m + (1-b1)*g ; v = b2*v + (1-b2)*g^2 ; vm = max(vmax, v)
    # r = (m/bc1) / (sqrt(vm/bc2) + eps)
    m1 = _mul32(B1, m) + _mul32(C1, d)
    v1 = _mul32(B2, v) + _mul32(C2, d * d)
    vm = max(vmax, v1)
    return m1, v1, vm, (m1 / D1) / (float32(math.sqrt(vm / D2)) + E)


@cuda.jit
def _cu_adam_update(p, g, m, v, vmax, pb, pseg, seg_wd, seg_c, gs, B1, C1, B2, C2, D1, D2, E,
                    amsgrad):
    # w -= c_s * (r + wd_s*w)
    i = cuda.grid(1)
    while i < p.shape[0]:
        s = pseg[_cu_piece_of(pb, i)]
        w = p[i]
        vm0 = vmax[i] if amsgrad else float32(0.0)
        m1, v1, vm1, r = _cu_adam_dir(g[i] * gs, m[i], v[i], vm0, B1, C1, B2, C2, D1, D2, E)
        m[i] = m1
        v[i] = v1
        if amsgrad:
            vmax[i] = vm1
        p[i] = w - _mul32(seg_c[s], r + _mul32(seg_wd[s], w))
        i += cuda.gridsize(1)


@cuda.jit
def _cu_momentum_update(p, g, buf, pb, pseg, seg_wd, seg_c, gs, decay, mom, lr, nesterov,
                        use_buf):
    # d = gscale*g + wd_s*w ; buf = decay*buf + c_s*d ; w -= lr*(d + mom*buf | buf)
    i = cuda.grid(1)
    while i < p.shape[0]:
        s = pseg[_cu_piece_of(pb, i)]
        w = p[i]
        d = _mul32(g[i], gs) + _mul32(seg_wd[s], w)
        if use_buf:
            b = _mul32(decay, buf[i]) + _mul32(seg_c[s], d)
            buf[i] = b
            p[i] = w - _mul32(lr, d + _mul32(mom, b) if nesterov else b)
        else:
            p[i] = w - _mul32(lr, seg_c[s] * d)
        i += cuda.gridsize(1)


@cuda.jit(device=True)
def _cu_block_sum(sh, k, out, c):
    t = cuda.threadIdx.x
    s = cuda.blockDim.x // 2
    while s > 0:
        if t < s:
            for j in range(k):
                sh[t, j] += sh[t + s, j]
        cuda.syncthreads()
        s //= 2
    if t == 0:
        for j in range(k):
            out[c, j] = sh[0, j]


@cuda.jit
def _cu_sumsq_pg(p, g, gs, lo, hi, out):
    # out[c] = (sum w^2, sum (gscale*g)^2) over chunk c, float64
    sh = cuda.shared.array((THREADS, 2), float64)
    c, t = cuda.blockIdx.x, cuda.threadIdx.x
    aw = 0.0
    ag = 0.0
    i = lo[c] + t
    while i < hi[c]:
        w = float(p[i])
        d = float(g[i] * gs)
        aw += _mul64(w, w)
        ag += _mul64(d, d)
        i += cuda.blockDim.x
    sh[t, 0] = aw
    sh[t, 1] = ag
    cuda.syncthreads()
    _cu_block_sum(sh, 2, out, c)


@cuda.jit
def _cu_lamb_sums(p, g, m, v, vmax, lo, hi, seg, seg_wd, gs, B1, C1, B2, C2, D1, D2, E,
                  amsgrad, out):
    # out[c] = (sum w^2, sum u^2, sum g^2), u = r + wd_s*w
    sh = cuda.shared.array((THREADS, 3), float64)
    c, t = cuda.blockIdx.x, cuda.threadIdx.x
    wd = seg_wd[seg[c]]
    aw = 0.0
    au = 0.0
    ag = 0.0
    i = lo[c] + t
    while i < hi[c]:
        w = p[i]
        d = g[i] * gs
        vm0 = vmax[i] if amsgrad else float32(0.0)
        _, _, _, r = _cu_adam_dir(d, m[i], v[i], vm0, B1, C1, B2, C2, D1, D2, E)
        u = float(r + _mul32(wd, w))
        aw += _mul64(float(w), float(w))
        au += _mul64(u, u)
        ag += _mul64(float(d), float(d))
        i += cuda.blockDim.x
    sh[t, 0] = aw
    sh[t, 1] = au
    sh[t, 2] = ag
    cuda.syncthreads()
    _cu_block_sum(sh, 3, out, c)


@cuda.jit
def _cu_onebit_momentum(m, g, den, B1, C1, M):
    # g = (b1*m + (1-b1)*(mult*g)) / den   (0 where den = 0)
    i = cuda.grid(1)
    while i < g.shape[0]:
        d = den[i]
        g[i] = (_mul32(B1, m[i]) + _mul32(C1, _mul32(M, g[i]))) / d if d > 0 else float32(0.0)
        i += cuda.gridsize(1)


@cuda.jit
def _cu_onebit_adam_update(p, m, v, ms, pb, pseg, seg_wd, seg_c, D1, D2, E):
    # r = (m/bc1)/(sqrt(v/bc2) + eps) (0 where v = 0) ; w -= c_s*(r + wd_s*w) ; ms = m
    i = cuda.grid(1)
    while i < p.shape[0]:
        s = pseg[_cu_piece_of(pb, i)]
        w = p[i]
        mi, vi = m[i], v[i]
        r = (mi / D1) / (float32(math.sqrt(vi / D2)) + E) if vi > 0 else float32(0.0)
        ms[i] = mi
        p[i] = w - _mul32(seg_c[s], r + _mul32(seg_wd[s], w))
        i += cuda.gridsize(1)


@cuda.jit(device=True)
def _cu_onebit_lamb_dir(w, m, mo, v, vf, B1, C1, B2, C2, D1, D2, D2F, E, wd):
    # g = (m - b1*m_old)/(1-b1) ; vf = b2*vf + (1-b2)*g^2 ; den = sqrt(v/bc2_f) + eps
    # r = (m/bc1)/den (0 where v = 0) ; u = r + wd*w ; q = den/(sqrt(vf/bc2) + eps)
    g = (m - _mul32(B1, mo)) / C1
    vf1 = _mul32(B2, vf) + _mul32(C2, g * g)
    den = float32(math.sqrt(v / D2)) + E
    r = (m / D1) / den if v > 0 else float32(0.0)
    return vf1, r, r + _mul32(wd, w), den / (float32(math.sqrt(vf1 / D2F)) + E)


@cuda.jit
def _cu_onebit_lamb_update(p, m, mo, v, vf, pb, pseg, seg_wd, seg_c, B1, C1, B2, C2, D1, D2,
                           D2F, E):
    # (vf, r, u) from _cu_onebit_lamb_dir ; w -= c_s*u ; m_old = m
    i = cuda.grid(1)
    while i < p.shape[0]:
        s = pseg[_cu_piece_of(pb, i)]
        w = p[i]
        vf1, _, u, _ = _cu_onebit_lamb_dir(w, m[i], mo[i], v[i], vf[i], B1, C1, B2, C2, D1, D2,
                                           D2F, E, seg_wd[s])
        vf[i] = vf1
        mo[i] = m[i]
        p[i] = w - _mul32(seg_c[s], u)
        i += cuda.gridsize(1)


@cuda.jit
def _cu_onebit_lamb_sums(p, m, mo, v, vf, lo, hi, seg, seg_wd, B1, C1, B2, C2, D1, D2, D2F, E,
                         out):
    # out[c] = (sum w^2, sum u^2, sum r^2, max q) over chunk c
    sh = cuda.shared.array((THREADS, 4), float64)
    c, t = cuda.blockIdx.x, cuda.threadIdx.x
    wd = seg_wd[seg[c]]
    aw = 0.0
    au = 0.0
    ar = 0.0
    top = float32(0.0)
    i = lo[c] + t
    while i < hi[c]:
        w = p[i]
        _, r, u, q = _cu_onebit_lamb_dir(w, m[i], mo[i], v[i], vf[i], B1, C1, B2, C2, D1, D2,
                                         D2F, E, wd)
        aw += _mul64(float(w), float(w))
        au += _mul64(float(u), float(u))
        ar += _mul64(float(r), float(r))
        top = max(top, q)
        i += cuda.blockDim.x
    sh[t, 0] = aw
    sh[t, 1] = au
    sh[t, 2] = ar
    sh[t, 3] = float(top)
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if t < s:
            for j in range(3):
                sh[t, j] += sh[t + s, j]
            sh[t, 3] = max(sh[t, 3], sh[t + s, 3])
        cuda.syncthreads()
        s //= 2
    if t == 0:
        for j in range(4):
            out[c, j] = sh[0, j]


class NumbaCudaKernels:
    """The numba.cuda kernels bound to one optimizer's Plan; arrays are CuPy on a GPU, or
    NumPy under the CUDA simulator. The methods are kernels.optim_cpu.CPUKernels's, documented
    there."""

    def __init__(self, plan):
        # the simulator runs every thread as a Python thread: small blocks there
        self.nseg, self.threads = plan.nseg, 32 if numba_config.ENABLE_CUDASIM else THREADS
        self.pb, self.pseg = cuda.to_device(plan.pbounds), cuda.to_device(plan.pseg)
        lo, hi, self.seg_host = gpu_chunks(plan)
        self.lo, self.hi, self.seg = (cuda.to_device(lo), cuda.to_device(hi),
                                      cuda.to_device(self.seg_host))
        self.nchunk = int(lo.shape[0])
        self.n = int(plan.pbounds[-1])

    def _grid(self):
        """One thread per element (the loads of many resident warps hide the piece search's
        latency; 1024 blocks of grid-stride loops ran at 25-33% of the triad on an H100);
        the simulator, which runs each thread in Python, gets at most 1024 blocks."""
        blocks = max(1, -(-self.n // self.threads))
        return min(1024, blocks) if numba_config.ENABLE_CUDASIM else blocks

    @staticmethod
    def _f32(x):
        return cuda.to_device(np.ascontiguousarray(x, dtype=np.float32))

    @staticmethod
    def _nonempty(a):
        """An unused state argument: a one-element array (kernels never index it)."""
        return a if a.shape[0] else cuda.device_array(1, np.float32)

    def all_finite(self, g) -> bool:
        return bool(get_array_module(g).isfinite(g).all())

    def _sums(self, kernel, k, args):
        out = cuda.device_array((self.nchunk, k), np.float64)
        if self.nchunk:
            kernel[self.nchunk, self.threads](*args, out)
        return segment_totals(out.copy_to_host(), self.seg_host, self.nseg)

    def sumsq_pg(self, p, g, gscale):
        return self._sums(_cu_sumsq_pg, 2, (p, g, np.float32(gscale), self.lo, self.hi))

    def lamb_sums(self, p, g, m, v, vmax, seg_wd, gscale, b1, b2, eps, bc1, bc2, amsgrad):
        return self._sums(_cu_lamb_sums, 3, (
            p, g, m, v, self._nonempty(vmax), self.lo, self.hi, self.seg, self._f32(seg_wd),
            *adam_consts(gscale, b1, b2, eps, bc1, bc2), bool(amsgrad)))

    def adam_update(self, p, g, m, v, vmax, seg_wd, seg_c, gscale, b1, b2, eps, bc1, bc2,
                    amsgrad):
        if self.n:
            _cu_adam_update[self._grid(), self.threads](
                p, g, m, v, self._nonempty(vmax), self.pb, self.pseg, self._f32(seg_wd),
                self._f32(seg_c), *adam_consts(gscale, b1, b2, eps, bc1, bc2), bool(amsgrad))

    def momentum_update(self, p, g, buf, seg_wd, seg_c, gscale, decay, mom, lr, nesterov,
                        use_buf):
        f = np.float32
        if self.n:
            _cu_momentum_update[self._grid(), self.threads](
                p, g, self._nonempty(buf), self.pb, self.pseg, self._f32(seg_wd),
                self._f32(seg_c), f(gscale), f(decay), f(mom), f(lr), bool(nesterov),
                bool(use_buf))

    # 1-bit Adam / LAMB (formulas beside the kernels above)
    def onebit_momentum(self, m, g, den, b1, mult):
        f = np.float32
        n = int(g.shape[0])
        if n:
            blocks = max(1, -(-n // self.threads))
            blocks = min(1024, blocks) if numba_config.ENABLE_CUDASIM else blocks
            _cu_onebit_momentum[blocks, self.threads](m, g, den, f(b1), f(1.0 - b1), f(mult))

    def onebit_adam_update(self, p, m, v, mstate, seg_wd, seg_c, bc1, bc2, eps):
        f = np.float32
        if self.n:
            _cu_onebit_adam_update[self._grid(), self.threads](
                p, m, v, mstate, self.pb, self.pseg, self._f32(seg_wd), self._f32(seg_c),
                f(bc1), f(bc2), f(eps))

    def onebit_lamb_sums(self, p, m, m_old, v, vf, seg_wd, b1, b2, eps, bc1, bc2, bc2f):
        out = cuda.device_array((self.nchunk, 4), np.float64)
        if self.nchunk:
            _cu_onebit_lamb_sums[self.nchunk, self.threads](
                p, m, m_old, v, vf, self.lo, self.hi, self.seg, self._f32(seg_wd),
                *onebit_lamb_consts(b1, b2, eps, bc1, bc2, bc2f), out)
        host = out.copy_to_host()
        tot = segment_totals(host[:, :3], self.seg_host, self.nseg)
        return np.concatenate([tot, segment_max(host[:, 3], self.seg_host, self.nseg)[:, None]], 1)

    def onebit_lamb_update(self, p, m, m_old, v, vf, seg_wd, seg_c, b1, b2, eps, bc1, bc2,
                           bc2f):
        if self.n:
            _cu_onebit_lamb_update[self._grid(), self.threads](
                p, m, m_old, v, vf, self.pb, self.pseg, self._f32(seg_wd), self._f32(seg_c),
                *onebit_lamb_consts(b1, b2, eps, bc1, bc2, bc2f))
