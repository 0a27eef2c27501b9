"""The optimizers' GPU kernels in CuPy: ElementwiseKernel updates and RawKernel segmented sums.

Element-wise updates run one thread per element; the element's segment comes from a binary
search over the range's piece bounds (`pbounds`, a few hundred entries), so no per-element
segment array is read. Segmented sums run one block per chunk, reduced in shared memory, and
come back to the host as (nseg, k) float64 for reduce_norms. Compiled without fused
multiply-add, so the rounding is the CPU reference's. CuPy is imported when the kernels are
first built (once per process; CuPy caches the binaries on disk).
See docs/ARCHITECTURE.md (kernels).
"""
from __future__ import annotations

import functools

import numpy as np

from mpidist.kernels.backend import cupy as _cupy
from mpidist.kernels.optim_cpu import segment_max, segment_totals
from mpidist.kernels.optim_gpu_shared import THREADS, adam_consts, gpu_chunks, onebit_lamb_consts

__all__ = ["CuPyKernels"]

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
    """The CuPy kernels bound to one optimizer's Plan (piece and chunk tables on the device);
    the methods are kernels.optim_cpu.CPUKernels's, documented there."""

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
