"""GPU kernels of the optimizers: CuPy (ElementwiseKernel / RawKernel) and numba.cuda.

Same contract as optim_cpu (float32 storage and element arithmetic with float32 coefficients
rounded once, no fused multiply-add, float64 sums of squares, one fused pass per update,
per-chunk sums summed per segment on the host), and the same interface (`CuPyKernels`,
`NumbaCudaKernels`) that mpidist.optim calls.

- Element-wise updates run one thread per element; the element's segment comes from a binary
  search over the range's piece bounds (`pbounds`, a few hundred entries, cached), so no
  per-element segment array is read.
- Segmented sums run one block per chunk (a piece cut into at most GPU_CHUNK elements),
  reduced in shared memory, and come back to the host as (nseg, k) float64 for reduce_norms.
- The numba.cuda versions accept CuPy arrays on a GPU, and NumPy arrays under Numba's CUDA
  simulator (NUMBA_ENABLE_CUDASIM=1 before numba is first imported), which is how the CPU
  test suite runs them. They compile on first launch.
mpidist.optim imports this module only when a GPU backend is used; CuPy is imported only
when the CuPy kernels are first built (once per process; CuPy caches binaries on disk).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import config as numba_config, cuda, float32, float64

from mpidist.kernels.backend import cupy as _cupy, get_array_module
from mpidist.kernels.optim_cpu import segment_max, segment_totals

__all__ = ["CuPyKernels", "NumbaCudaKernels", "adam_consts", "onebit_lamb_consts", "gpu_chunks",
           "GPU_CHUNK", "THREADS"]

GPU_CHUNK = 8192      # elements per block of a segmented sum
THREADS = 256         # threads per block (a power of two: the shared-memory tree needs it)


def gpu_chunks(plan, chunk: int = GPU_CHUNK):
    """(lo, hi, seg) int64: the plan's pieces cut into chunks of at most `chunk` elements."""
    lo, hi, seg = [], [], []
    for k, s in enumerate(plan.pseg):
        a, b = int(plan.pbounds[k]), int(plan.pbounds[k + 1])
        starts = np.arange(a, b, chunk, dtype=np.int64)
        lo.append(starts)
        hi.append(np.minimum(starts + chunk, b))
        seg.append(np.full(starts.shape, s, np.int64))
    cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))
    return cat(lo), cat(hi), cat(seg)


def adam_consts(gscale, b1, b2, eps, bc1, bc2):
    """The float32 coefficients (gs, B1, C1, B2, C2, D1, D2, E) of the Adam direction,
    rounded once from the float64 hyperparameters (as optim_cpu._adam_consts)."""
    f = np.float32
    return (f(gscale), f(b1), f(1.0 - b1), f(b2), f(1.0 - b2), f(bc1), f(bc2), f(eps))


def onebit_lamb_consts(b1, b2, eps, bc1, bc2, bc2f):
    """The float32 coefficients (B1, C1, B2, C2, D1, D2, D2F, E) of 1-bit LAMB's compression
    stage, rounded once (as optim_cpu._onebit_lamb_consts)."""
    f = np.float32
    return (f(b1), f(1.0 - b1), f(b2), f(1.0 - b2), f(bc1), f(bc2), f(bc2f), f(eps))


# ------------------------------------------------------------------------------------ CuPy
_CUDA_COMMON = r"""
// index of the piece holding local element i: pb[k] <= i < pb[k+1]
__device__ __forceinline__ long long piece_of(const long long* pb, long long npiece, long long i) {
    long long lo = 0, hi = npiece;
    while (hi - lo > 1) {
        long long mid = (lo + hi) / 2;
        if (pb[mid] <= i) lo = mid; else hi = mid;
    }
    return lo;
}
// m = b1*m + (1-b1)*g ; v = b2*v + (1-b2)*g^2 ; vm = max(vmax, v) ; r = (m/bc1) / (sqrt(vm/bc2) + eps)
// (float32; without amsgrad the caller passes vmax = 0, so vm = v)
__device__ __forceinline__ float adam_dir(float d, float m, float v, float vmax, float B1,
        float C1, float B2, float C2, float D1, float D2, float E, float* m1, float* v1,
        float* vm1) {
    *m1 = B1 * m + C1 * d;
    *v1 = B2 * v + C2 * (d * d);
    *vm1 = fmaxf(vmax, *v1);
    return (*m1 / D1) / (sqrtf(*vm1 / D2) + E);
}
"""

_CUDA_COMMON += r"""
// 1-bit LAMB, compression stage (float32): g = (m - b1*m_old)/(1-b1) ; vf = b2*vf + (1-b2)*g^2
// den = sqrt(v/bc2_frozen) + eps ; r = (m/bc1)/den (0 where v = 0) ; u = r + wd*w
// q = den / (sqrt(vf/bc2) + eps)
__device__ __forceinline__ void onebit_lamb_dir(float w, float m, float mo, float v, float vf,
        float B1, float C1, float B2, float C2, float D1, float D2, float D2F, float E, float wd,
        float* vf1, float* r, float* u, float* q) {
    float g = (m - B1 * mo) / C1;
    *vf1 = B2 * vf + C2 * (g * g);
    float den = sqrtf(v / D2) + E;
    *r = v > 0.0f ? (m / D1) / den : 0.0f;
    *u = *r + wd * w;
    *q = den / (sqrtf(*vf1 / D2F) + E);
}
"""

_CUDA_SUMS = _CUDA_COMMON + r"""
// block-wide sum of K values per thread into out[c*K + j] (blockDim a power of two)
template <int K>
__device__ void block_sum(double (*sh)[K], double* acc, double* out, int c) {
    int t = threadIdx.x;
    for (int j = 0; j < K; ++j) sh[t][j] = acc[j];
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) for (int j = 0; j < K; ++j) sh[t][j] += sh[t + s][j];
        __syncthreads();
    }
    if (t == 0) for (int j = 0; j < K; ++j) out[(long long)c * K + j] = sh[0][j];
}

// LARS norms: out[c] = (sum w^2, sum (gscale*g)^2) over chunk c, float64
extern "C" __global__ void sumsq_pg(const float* p, const float* g, float gs,
        const long long* lo, const long long* hi, double* out) {
    __shared__ double sh[THREADS][2];
    double acc[2] = {0.0, 0.0};
    int c = blockIdx.x;
    for (long long i = lo[c] + threadIdx.x; i < hi[c]; i += blockDim.x) {
        double w = p[i], d = (double)(g[i] * gs);
        acc[0] += w * w; acc[1] += d * d;
    }
    block_sum<2>(sh, acc, out, c);
}

// LAMB phase 1: out[c] = (sum w^2, sum u^2, sum g^2), u = r + wd_s*w (nothing written)
extern "C" __global__ void lamb_sums(const float* p, const float* g, const float* m,
        const float* v, const float* vmax, const long long* lo, const long long* hi,
        const long long* seg, const float* seg_wd, float gs, float B1, float C1, float B2,
        float C2, float D1, float D2, float E, int amsgrad, double* out) {
    __shared__ double sh[THREADS][3];
    double acc[3] = {0.0, 0.0, 0.0};
    int c = blockIdx.x;
    float wd = seg_wd[seg[c]];
    for (long long i = lo[c] + threadIdx.x; i < hi[c]; i += blockDim.x) {
        float w = p[i], d = g[i] * gs, m1, v1, vm1;
        float r = adam_dir(d, m[i], v[i], amsgrad ? vmax[i] : 0.0f, B1, C1, B2, C2, D1, D2, E,
                           &m1, &v1, &vm1);
        double u = (double)(r + wd * w), wf = w, df = d;
        acc[0] += wf * wf; acc[1] += u * u; acc[2] += df * df;
    }
    block_sum<3>(sh, acc, out, c);
}

// 1-bit LAMB phase 1: out[c] = (sum w^2, sum u^2, sum r^2, max q) (nothing written)
extern "C" __global__ void onebit_lamb_sums(const float* p, const float* m, const float* mo,
        const float* v, const float* vf, const long long* lo, const long long* hi,
        const long long* seg, const float* seg_wd, float B1, float C1, float B2, float C2,
        float D1, float D2, float D2F, float E, double* out) {
    __shared__ double sh[THREADS][3];
    __shared__ float top[THREADS];
    double acc[3] = {0.0, 0.0, 0.0};
    float best = 0.0f;
    int c = blockIdx.x, t = threadIdx.x;
    float wd = seg_wd[seg[c]];
    for (long long i = lo[c] + t; i < hi[c]; i += blockDim.x) {
        float vf1, r, u, q;
        onebit_lamb_dir(p[i], m[i], mo[i], v[i], vf[i], B1, C1, B2, C2, D1, D2, D2F, E, wd,
                        &vf1, &r, &u, &q);
        double wf = p[i], uf = u, rf = r;
        acc[0] += wf * wf; acc[1] += uf * uf; acc[2] += rf * rf;
        best = fmaxf(best, q);
    }
    top[t] = best;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) top[t] = fmaxf(top[t], top[t + s]);
        __syncthreads();
    }
    double mine[3] = {acc[0], acc[1], acc[2]};
    block_sum<3>(sh, mine, out + (long long)c * 4, 0);   // row c of 4 columns
    if (t == 0) out[(long long)c * 4 + 3] = top[0];
}
"""

# AdamW, and LAMB phase 2:  w -= c_s * (r + wd_s*w)
_ADAM_OP = r"""
    long long s = pseg[piece_of(&pb[0], npiece, i)];
    float w = p, m1, v1, vm1;
    float r = adam_dir(g * gs, m, v, amsgrad ? vmax[i] : 0.0f, B1, C1, B2, C2, D1, D2, E,
                       &m1, &v1, &vm1);
    m = m1;
    v = v1;
    if (amsgrad) vmax[i] = vm1;
    p = w - seg_c[s] * (r + seg_wd[s] * w);
"""

# SGD and LARS:  d = gscale*g + wd_s*w ; buf = decay*buf + c_s*d ;
#                w -= lr * (d + mom*buf if nesterov else buf) ; no buffer: w -= lr*(c_s*d)
_MOMENTUM_OP = r"""
    long long s = pseg[piece_of(&pb[0], npiece, i)];
    float w = p;
    float d = g * gs + seg_wd[s] * w;
    if (use_buf) {
        float b = decay * buf[i] + seg_c[s] * d;
        buf[i] = b;
        p = w - lr * (nesterov ? d + mom * b : b);
    } else {
        p = w - lr * (seg_c[s] * d);
    }
"""


# 1-bit local momentum:  g = (b1*m + (1-b1)*(mult*g)) / den   (0 where den = 0)
_ONEBIT_MOMENTUM_OP = r"""
    g = den > 0.0f ? (B1 * m + C1 * (M * g)) / den : 0.0f;
"""

# 1-bit Adam:  r = (m/bc1)/(sqrt(v/bc2) + eps) (0 where v = 0) ;  w -= c_s*(r + wd_s*w) ;  ms = m
_ONEBIT_ADAM_OP = r"""
    long long s = pseg[piece_of(&pb[0], npiece, i)];
    float w = p;
    float r = v > 0.0f ? (m / D1) / (sqrtf(v / D2) + E) : 0.0f;
    ms = m;
    p = w - seg_c[s] * (r + seg_wd[s] * w);
"""

# 1-bit LAMB phase 2:  (vf, r, u) from onebit_lamb_dir ;  w -= c_s*u ;  mo = m
_ONEBIT_LAMB_OP = r"""
    long long s = pseg[piece_of(&pb[0], npiece, i)];
    float w = p, vf1, r, u, q;
    onebit_lamb_dir(w, m, mo, v, vf, B1, C1, B2, C2, D1, D2, D2F, E, seg_wd[s], &vf1, &r, &u, &q);
    vf = vf1;
    mo = m;
    p = w - seg_c[s] * u;
"""


@functools.lru_cache(maxsize=None)
def _cupy_onebit():
    """The 1-bit optimizers' CuPy kernels, built once per process."""
    cp = _cupy()
    opts = ("--fmad=false",)
    momentum = cp.ElementwiseKernel(
        "float32 m, float32 den, float32 B1, float32 C1, float32 M", "float32 g",
        _ONEBIT_MOMENTUM_OP, "mpidist_onebit_momentum", options=opts)
    adam = cp.ElementwiseKernel(
        "float32 m, float32 v, raw int64 pb, raw int64 pseg, int64 npiece, raw float32 seg_wd, "
        "raw float32 seg_c, float32 D1, float32 D2, float32 E", "float32 p, float32 ms",
        _ONEBIT_ADAM_OP, "mpidist_onebit_adam", preamble=_CUDA_COMMON, options=opts)
    lamb = cp.ElementwiseKernel(
        "float32 m, float32 v, raw int64 pb, raw int64 pseg, int64 npiece, raw float32 seg_wd, "
        "raw float32 seg_c, float32 B1, float32 C1, float32 B2, float32 C2, float32 D1, "
        "float32 D2, float32 D2F, float32 E", "float32 p, float32 mo, float32 vf",
        _ONEBIT_LAMB_OP, "mpidist_onebit_lamb", preamble=_CUDA_COMMON, options=opts)
    module = cp.RawModule(code=f"#define THREADS {THREADS}\n" + _CUDA_SUMS,
                          options=opts + ("-std=c++14",))
    return momentum, adam, lamb, module.get_function("onebit_lamb_sums")


@functools.lru_cache(maxsize=None)
def _cupy_kernels():
    """Build the CuPy kernels once per process (CuPy caches the binaries on disk)."""
    cp = _cupy()
    opts = ("--fmad=false",)   # no fused multiply-add: the same rounding as the reference
    adam = cp.ElementwiseKernel(
        "float32 g, raw int64 pb, raw int64 pseg, int64 npiece, raw float32 seg_wd, "
        "raw float32 seg_c, float32 gs, float32 B1, float32 C1, float32 B2, float32 C2, "
        "float32 D1, float32 D2, float32 E, int32 amsgrad",
        "float32 p, float32 m, float32 v, raw float32 vmax",
        _ADAM_OP, "mpidist_adam_update", preamble=_CUDA_COMMON, options=opts)
    momentum = cp.ElementwiseKernel(
        "float32 g, raw int64 pb, raw int64 pseg, int64 npiece, raw float32 seg_wd, "
        "raw float32 seg_c, float32 gs, float32 decay, float32 mom, float32 lr, "
        "int32 nesterov, int32 use_buf",
        "float32 p, raw float32 buf",
        _MOMENTUM_OP, "mpidist_momentum_update", preamble=_CUDA_COMMON, options=opts)
    module = cp.RawModule(code=f"#define THREADS {THREADS}\n" + _CUDA_SUMS,
                          options=opts + ("-std=c++14",))
    return adam, momentum, module.get_function("sumsq_pg"), module.get_function("lamb_sums")


class CuPyKernels:
    """The CuPy kernels bound to one optimizer's Plan (piece and chunk tables on the device)."""

    def __init__(self, plan):
        cp = _cupy()
        self.cp, self.nseg = cp, plan.nseg
        self.pb, self.pseg = cp.asarray(plan.pbounds), cp.asarray(plan.pseg)
        self.npiece = int(plan.pseg.shape[0])
        lo, hi, self.seg_host = gpu_chunks(plan)
        self.lo, self.hi, self.seg = cp.asarray(lo), cp.asarray(hi), cp.asarray(self.seg_host)
        self.adam, self.momentum, self.sumsq, self.lamb = _cupy_kernels()

    def _f32(self, x):
        return self.cp.asarray(x, dtype=np.float32)

    def all_finite(self, g) -> bool:
        return bool(self.cp.isfinite(g).all())

    def _sums(self, kernel, k, args):
        nchunk = int(self.lo.shape[0])
        out = self.cp.zeros((nchunk, k), np.float64)
        if nchunk:
            kernel((nchunk,), (THREADS,), args + (out,))
        return segment_totals(out.get(), self.seg_host, self.nseg)

    def sumsq_pg(self, p, g, gscale):
        return self._sums(self.sumsq, 2, (p, g, np.float32(gscale), self.lo, self.hi))

    def lamb_sums(self, p, g, m, v, vmax, seg_wd, gscale, b1, b2, eps, bc1, bc2, amsgrad):
        return self._sums(self.lamb, 3, (
            p, g, m, v, vmax, self.lo, self.hi, self.seg, self._f32(seg_wd),
            *adam_consts(gscale, b1, b2, eps, bc1, bc2), np.int32(amsgrad)))

    def adam_update(self, p, g, m, v, vmax, seg_wd, seg_c, gscale, b1, b2, eps, bc1, bc2,
                    amsgrad):
        self.adam(g, self.pb, self.pseg, self.npiece, self._f32(seg_wd), self._f32(seg_c),
                  *adam_consts(gscale, b1, b2, eps, bc1, bc2), np.int32(amsgrad), p, m, v, vmax)

    def momentum_update(self, p, g, buf, seg_wd, seg_c, gscale, decay, mom, lr, nesterov,
                        use_buf):
        f = np.float32
        self.momentum(g, self.pb, self.pseg, self.npiece, self._f32(seg_wd), self._f32(seg_c),
                      f(gscale), f(decay), f(mom), f(lr), np.int32(nesterov), np.int32(use_buf),
                      p, buf)

    # 1-bit Adam / LAMB (formulas beside the CUDA sources above)
    def onebit_momentum(self, m, g, den, b1, mult):
        f = np.float32
        if g.size:
            _cupy_onebit()[0](m, den, f(b1), f(1.0 - b1), f(mult), g)

    def onebit_adam_update(self, p, m, v, mstate, seg_wd, seg_c, bc1, bc2, eps):
        f = np.float32
        if p.size:
            _cupy_onebit()[1](m, v, self.pb, self.pseg, self.npiece, self._f32(seg_wd),
                              self._f32(seg_c), f(bc1), f(bc2), f(eps), p, mstate)

    def onebit_lamb_sums(self, p, m, m_old, v, vf, seg_wd, b1, b2, eps, bc1, bc2, bc2f):
        nchunk = int(self.lo.shape[0])
        out = self.cp.zeros((nchunk, 4), np.float64)
        if nchunk:
            _cupy_onebit()[3]((nchunk,), (THREADS,), (
                p, m, m_old, v, vf, self.lo, self.hi, self.seg, self._f32(seg_wd),
                *onebit_lamb_consts(b1, b2, eps, bc1, bc2, bc2f), out))
        host = out.get()
        tot = segment_totals(host[:, :3], self.seg_host, self.nseg)
        return np.concatenate([tot, segment_max(host[:, 3], self.seg_host, self.nseg)[:, None]], 1)

    def onebit_lamb_update(self, p, m, m_old, v, vf, seg_wd, seg_c, b1, b2, eps, bc1, bc2,
                           bc2f):
        if p.size:
            _cupy_onebit()[2](m, v, self.pb, self.pseg, self.npiece, self._f32(seg_wd),
                              self._f32(seg_c), *onebit_lamb_consts(b1, b2, eps, bc1, bc2, bc2f),
                              p, m_old, vf)


# ------------------------------------------------------------------------------ numba.cuda
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
    NumPy under the CUDA simulator."""

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
