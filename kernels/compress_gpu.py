"""GPU kernels of the gradient compressors: numba.cuda kernels over CuPy arrays.

Same names and signatures as `compress_cpu`, so a compressor picks its module from the data
(`mpidist.kernels.dispatch.kernels_for`). The per-element formulas are the CPU module's scalar
functions, compiled for the device from the same Python source (`.py_func`): one formula,
two devices. Kernels are built on first use and cached, so importing this module needs
neither CuPy nor a GPU; under NUMBA_ENABLE_CUDASIM=1 they run in Numba's CUDA simulator on
NumPy arrays. Reductions and the top-k selection passes use CuPy's own kernels (written over
the array module of the data, so they run on NumPy arrays under the simulator too).
See docs/ARCHITECTURE.md (compression).
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
from numba import cuda   # importing numba.cuda needs no GPU; kernels compile on first use

from mpidist.kernels import compress_cpu as _cpu
from mpidist.kernels.backend import is_cupy

__all__ = ["absmax_bits", "all_finite", "fp16_encode", "bf16_encode", "fp16_decode",
           "bf16_decode", "sign_encode",
           "sign_encode_feedback", "sign_decode_add", "qsgd_encode", "qsgd_decode_add", "randomk_indices", "sample_abs",
           "collect_above", "select_k"]

_TPB = 128


def _blocks(n: int) -> int:
    return max(1, -(-int(n) // _TPB))


@functools.lru_cache(maxsize=None)
def _kernels() -> SimpleNamespace:
    f16_bits = cuda.jit(device=True)(_cpu.f16_bits.py_func)
    bf16_bits = cuda.jit(device=True)(_cpu.bf16_bits.py_func)
    f32_bits_of_f16 = cuda.jit(device=True)(_cpu.f32_bits_of_f16.py_func)
    uniform = cuda.jit(device=True)(_cpu.uniform.py_func)
    abs_sum = cuda.jit(device=True)(_cpu.abs_sum.py_func)
    qsgd_code = cuda.jit(device=True)(_cpu.qsgd_code.py_func)

    @cuda.jit
    def fp16(bits, k, out):
        # out[i] = float16(x[i] * 2**k), round to nearest even
        i = cuda.grid(1)
        if i < bits.size:
            out[i] = f16_bits(bits[i], k)

    @cuda.jit
    def bf16(bits, out):
        # out[i] = bfloat16(x[i]), round to nearest even
        i = cuda.grid(1)
        if i < bits.size:
            out[i] = bf16_bits(bits[i])

    @cuda.jit
    def fp16_widen(half, out):
        # out[i] = float32 bits of float16 bits half[i] (exact)
        i = cuda.grid(1)
        if i < half.size:
            out[i] = f32_bits_of_f16(half[i])

    @cuda.jit
    def bf16_widen(half, out):
        # out[i] = float32 bits of bfloat16 bits half[i]: its top half
        i = cuda.grid(1)
        if i < half.size:
            out[i] = np.uint32(half[i]) << np.uint32(16)

    @cuda.jit
    def chunk_mean_abs(x, chunk, scales):
        # scale_c = mean |x| over chunk c (one thread per chunk)
        c = cuda.grid(1)
        if c < scales.size:
            lo = c * chunk
            hi = min(x.size, lo + chunk)
            scales[c] = abs_sum(x, lo, hi) / (hi - lo)

    @cuda.jit
    def sign_pack(x, packed):
        # bit t of byte j = (x[8j + t] >= 0)
        j = cuda.grid(1)
        if j < packed.size:
            v = 0
            for t in range(min(8, x.size - 8 * j)):
                if x[8 * j + t] >= 0:
                    v |= 1 << t
            packed[j] = v

    @cuda.jit
    def sign_unpack_add(packed, scales, chunk, out):
        # out[i] += +scale or -scale
        i = cuda.grid(1)
        if i < out.size:
            s = scales[i // chunk]
            out[i] += s if (packed[i // 8] >> (i % 8)) & 1 else -s

    @cuda.jit
    def bucket_max_abs(x, bucket, norms):
        # norm_b = max |x| over bucket b (one thread per bucket)
        b = cuda.grid(1)
        if b < norms.size:
            m = np.float32(0.0)
            for i in range(b * bucket, min(x.size, (b + 1) * bucket)):
                m = max(m, abs(x[i]))
            norms[b] = m

    @cuda.jit
    def qsgd_pack(x, levels, bucket, width, seed, norms, codes):
        # code = sign | floor(|x| / norm * s + u), 8 / width codes per byte
        j = cuda.grid(1)
        per = 8 // width
        if j < codes.size:
            m = norms[(j * per) // bucket]
            scale = np.float32(levels) / m if m > 0 else np.float32(0.0)
            v = np.uint32(0)
            for t in range(per):
                i = j * per + t
                if i < x.size:
                    v |= qsgd_code(x[i], scale, levels, uniform(seed, i), width) << \
                        np.uint32(t * width)
            codes[j] = v

    @cuda.jit
    def qsgd_unpack_add(codes, norms, levels, bucket, width, out):
        # out[i] += sign * norm * level / s
        i = cuda.grid(1)
        if i < out.size:
            per = 8 // width
            code = (np.int64(codes[i // per]) >> ((i % per) * width)) & ((1 << width) - 1)
            q = norms[i // bucket] * (code & ((1 << (width - 1)) - 1)) / levels
            out[i] += -q if code >> (width - 1) else q

    @cuda.jit
    def randomk(n, k, seed, out):
        # one index per stratum [b n / k, (b + 1) n / k)
        b = cuda.grid(1)
        if b < k:
            lo = (b * n) // k
            hi = ((b + 1) * n) // k
            out[b] = lo + min(hi - lo - 1, np.int64(uniform(seed, b) * (hi - lo)))

    @cuda.jit
    def sample(x, seed, out):
        j = cuda.grid(1)
        if j < out.size:
            out[j] = abs(x[min(x.size - 1, np.int64(uniform(seed, j) * x.size))])

    return SimpleNamespace(fp16=fp16, bf16=bf16, fp16_widen=fp16_widen, bf16_widen=bf16_widen,
                           chunk_mean_abs=chunk_mean_abs,
                           sign_pack=sign_pack, sign_unpack_add=sign_unpack_add,
                           bucket_max_abs=bucket_max_abs, qsgd_pack=qsgd_pack,
                           qsgd_unpack_add=qsgd_unpack_add, randomk=randomk, sample=sample)


@functools.lru_cache(maxsize=None)
def _absmax_reduction():
    """One CuPy reduction pass over the bits (masking first made a temporary: three passes)."""
    import cupy as cp            # optional: only CuPy data comes here
    return cp.ReductionKernel("uint32 b", "uint32 m", "b & 0x7FFFFFFFu", "max(a, b)", "m = a",
                              "0", "mpidist_absmax_bits")


def absmax_bits(bits):
    """max |x| as float32 bit patterns (> 0x7F800000: a NaN is present)."""
    if bits.size == 0:
        return 0
    if is_cupy(bits):
        return int(_absmax_reduction()(bits))
    return int((bits & np.uint32(0x7FFFFFFF)).max())      # NumPy arrays: the simulator


def all_finite(bits) -> bool:
    """Whether every float32 (as uint32 bits) is finite."""
    return absmax_bits(bits) < 0x7F800000


def fp16_encode(bits, k, out) -> None:
    """out = float16(x * 2**k) as bits, x given as uint32 bits (as compress_cpu.fp16_encode)."""
    if bits.size:
        _kernels().fp16[_blocks(bits.size), _TPB](bits, int(k), out)


def bf16_encode(bits, out) -> None:
    """Round float32 bits to bfloat16 bits into out (as compress_cpu.bf16_encode)."""
    if bits.size:
        _kernels().bf16[_blocks(bits.size), _TPB](bits, out)


def fp16_decode(half, out) -> None:
    """Widen float16 bits to float32 into out."""
    if half.size:
        _kernels().fp16_widen[_blocks(half.size), _TPB](half, out)


def bf16_decode(half, out) -> None:
    """Widen bfloat16 bits to float32 into out."""
    if half.size:
        _kernels().bf16_widen[_blocks(half.size), _TPB](half, out)


def sign_encode(x, chunk, packed, scales) -> None:
    """Pack the signs of x into packed and each chunk's mean |x| into scales."""
    if x.size:
        K = _kernels()
        K.chunk_mean_abs[_blocks(scales.size), _TPB](x, int(chunk), scales)
        K.sign_pack[_blocks(packed.size), _TPB](x, packed)



def sign_encode_feedback(x, r, chunk, packed, scales) -> None:
    """Error feedback: v = x + r encoded as sign_encode does, r <- v - decoded(v)."""
    if x.size:
        v = x + r
        sign_encode(v, chunk, packed, scales)
        kept = np.zeros_like(v)      # CuPy's, for a CuPy v
        sign_decode_add(packed, scales, chunk, kept)
        r[...] = v - kept

def sign_decode_add(packed, scales, chunk, out) -> None:
    """Add the unpacked signs times their chunk's scale to out."""
    if out.size:
        _kernels().sign_unpack_add[_blocks(out.size), _TPB](packed, scales, int(chunk), out)


def qsgd_encode(x, levels, bucket, width, seed, codes, norms) -> None:
    """QSGD: each bucket's max |x| into norms, stochastically rounded levels into codes."""
    if x.size:
        K = _kernels()
        K.bucket_max_abs[_blocks(norms.size), _TPB](x, int(bucket), norms)
        K.qsgd_pack[_blocks(codes.size), _TPB](x, int(levels), int(bucket), int(width),
                                                int(seed), norms, codes)


def qsgd_decode_add(codes, norms, levels, bucket, width, out) -> None:
    """Add the decoded QSGD levels times their bucket's norm to out."""
    if out.size:
        _kernels().qsgd_unpack_add[_blocks(out.size), _TPB](codes, norms, int(levels),
                                                            int(bucket), int(width), out)


def randomk_indices(n, k, seed, out) -> None:
    """k distinct indices of [0, n) drawn from seed into out, the same on every rank."""
    if k:
        _kernels().randomk[_blocks(k), _TPB](int(n), int(k), int(seed), out)


def sample_abs(x, seed, out) -> None:
    """|x| at out.size pseudo-random positions: the CPU kernel's positions, from (seed, j)."""
    if out.size:
        _kernels().sample[_blocks(out.size), _TPB](x, int(seed), out)


@functools.lru_cache(maxsize=None)
def _abs_at_least():
    import cupy as cp            # optional: only CuPy data comes here
    return cp.ElementwiseKernel("T x, T thr", "bool m", "m = (x < 0 ? -x : x) >= thr",
                                "mpidist_abs_at_least")


def collect_above(x, thr, idx) -> int:
    """Indices i (ascending) with |x[i]| >= thr into idx; returns how many there are
    (may exceed idx.size: then idx holds the first idx.size of them)."""
    if is_cupy(x):                                # one pass, no |x| temporary
        import cupy as cp                         # optional: x is a CuPy array
        mask = _abs_at_least()(x, cp.asarray(thr, dtype=x.dtype))
    else:
        mask = np.abs(x) >= thr
    found = mask.nonzero()[0]
    m = min(found.size, idx.size)
    idx[:m] = found[:m]
    return int(found.size)


def select_k(x, cand, kth, k, idx, vals) -> int:
    """The k largest |x| among candidates, in ascending index order: every |x| > kth, then
    the first ones equal to kth until k are taken (the CPU kernel's choice among ties)."""
    a = abs(x[cand])
    above = a > kth
    tie = a == kth
    keep = above | (tie & (tie.cumsum() <= k - int(above.sum())))
    chosen = cand[keep]
    c = chosen.size
    idx[:c] = chosen
    vals[:c] = x[chosen]
    return int(c)
