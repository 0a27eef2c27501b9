"""CPU (Numba) kernels of the gradient compressors: one pass over the input each. The
fp16/bf16 casts also serve the collectives, which reduce half precision in float32
(NumPy's own float16 casts run a scalar loop, slower than these bit manipulations).

The per-element formulas are leaf scalar functions (`f16_bits`, `bf16_bits`,
`f32_bits_of_f16`, `uniform`, `qsgd_code`, `abs_sum`) that call nothing else, so the GPU module
compiles the very same Python source (`.py_func`) with numba.cuda: the formula is written
once for both devices.

Integer arithmetic stays in explicitly typed unsigned values (no mixed signed/unsigned
promotion to float, no 64-bit overflow), which keeps the scalar functions exact under
Numba CPU, numba.cuda and the CUDA simulator alike.
See docs/ARCHITECTURE.md (compression).
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["absmax_bits", "all_finite", "fp16_encode", "fp16_decode_add", "bf16_encode", "fp16_decode",
           "bf16_decode", "sign_encode", "sign_encode_feedback", "sign_decode_add", "qsgd_width",
           "qsgd_encode", "qsgd_decode_add", "randomk_indices", "sample_abs", "collect_above", "select_k",
           "scatter_add",
           # the scalar formulas, which compress_gpu compiles for the device too
           "f16_bits", "bf16_bits", "f32_bits_of_f16", "uniform", "qsgd_code", "abs_sum"]
_ABS = np.uint32(0x7FFFFFFF)
_INF32 = np.uint32(0x7F800000)


# ---------------------------------------------------------------- scalar formulas (CPU + GPU)
@njit(cache=True)
def f16_bits(b, k):
    """float32 bits b, times 2**k, rounded to the nearest-even float16 bit pattern.

    Zero and float32 subnormals (|x| < 2**-126) give signed zero; NaN stays NaN, inf and
    overflow give inf; results below the float16 normal range become float16 subnormals.
    """
    b = np.uint32(b)
    sign = np.uint32((b >> np.uint32(16)) & np.uint32(0x8000))
    e = np.int32((b >> np.uint32(23)) & np.uint32(0xFF))
    m = np.uint32(b & np.uint32(0x7FFFFF))
    if e == 255:
        return np.uint16(sign | (np.uint32(0x7E00) if m != 0 else np.uint32(0x7C00)))
    if e == 0:
        return np.uint16(sign)
    he = np.int32(e + k - 112)           # float16 biased exponent (127 - 15 = 112)
    if he >= 31:
        return np.uint16(sign | np.uint32(0x7C00))
    if he <= 0:
        if he < -10:
            return np.uint16(sign)
        mant = m | np.uint32(0x800000)
        shift = np.uint32(14 - he)
        h = mant >> shift
        rem = mant & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
        if rem > half or (rem == half and (h & np.uint32(1)) != 0):
            h += np.uint32(1)
        return np.uint16(sign | h)
    h = (np.uint32(he) << np.uint32(10)) | (m >> np.uint32(13))
    rem = m & np.uint32(0x1FFF)
    if rem > np.uint32(0x1000) or (rem == np.uint32(0x1000) and (h & np.uint32(1)) != 0):
        h += np.uint32(1)                # a carry rolls into the exponent (or to inf)
    return np.uint16(sign | h)


@njit(cache=True)
def bf16_bits(b):
    """float32 bits b rounded to the nearest-even bfloat16 bit pattern (NaN kept quiet)."""
    b = np.uint32(b)
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
    lsb = (b >> np.uint32(16)) & np.uint32(1)
    return np.uint16((np.uint64(b) + np.uint64(0x7FFF) + np.uint64(lsb)) >> np.uint64(16))


@njit(cache=True)
def f32_bits_of_f16(h):
    """The float32 bit pattern of float16 bits h, exactly (every float16 is a float32;
    NaN payloads kept, as NumPy's cast keeps them)."""
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    e = (h >> np.uint32(10)) & np.uint32(0x1F)
    m = h & np.uint32(0x3FF)
    if e == 31:
        return sign | np.uint32(0x7F800000) | (m << np.uint32(13))
    if e != 0:                           # rebias the exponent: 127 - 15 = 112
        return sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
    if m == 0:
        return sign
    e32 = np.uint32(113)                 # a subnormal m * 2**-24: normalise the mantissa
    while (m & np.uint32(0x400)) == 0:
        m <<= np.uint32(1)
        e32 -= np.uint32(1)
    return sign | (e32 << np.uint32(23)) | ((m & np.uint32(0x3FF)) << np.uint32(13))


@njit(cache=True)
def uniform(seed, i):
    """Counter-based uniform in [0, 1) of (seed, i): a 32-bit integer mixer (lowbias32).

    Products are of 32-bit values in 64-bit registers, so nothing overflows anywhere.
    """
    x = ((np.uint64(i) * np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF)) ^ \
        (np.uint64(seed) & np.uint64(0xFFFFFFFF))
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    return np.float32(x >> np.uint64(8)) * np.float32(1.0 / 16777216.0)


@njit(cache=True)
def qsgd_code(v, s_over_norm, levels, u, width):
    """QSGD code of v: sign bit | level, level = floor(|v| / norm * s + u) (unbiased)."""
    lev = np.int32(abs(v) * s_over_norm + u)
    if lev > levels:
        lev = levels
    code = np.uint32(lev)
    if v < 0:
        code |= np.uint32(1) << np.uint32(width - 1)
    return code


# ---------------------------------------------------------------- reductions and checks
@njit(cache=True)
def absmax_bits(bits):
    """max |x| as float32 bit patterns (monotonic for non-negative floats); > 0x7F800000
    marks a NaN, == 0x7F800000 an inf."""
    best = np.uint32(0)
    for i in range(bits.size):
        a = bits[i] & _ABS
        if a > best:
            best = a
    return best


@njit(cache=True)
def all_finite(bits):
    """True when no float32 (given as uint32 bits) is inf or NaN."""
    bad = 0
    for i in range(bits.size):
        bad |= (bits[i] & _ABS) >= _INF32
    return bad == 0


# ---------------------------------------------------------------- fp16 / bf16 casting
@njit(cache=True)
def fp16_encode(bits, k, out):
    """out[i] = float16(x[i] * 2**k), round to nearest even (bits: x viewed as uint32)."""
    for i in range(bits.size):
        out[i] = f16_bits(bits[i], k)


@njit(cache=True)
def fp16_decode_add(half, pow2, out):
    """out[i] += float16 bits half[i] as a number times 2**-k: mantissa (with the implicit
    1024 for normal numbers) times pow2[exponent] (= 2**(e - 25 - k), pow2[0] = 2**(-24 - k)),
    exact in float64 and rounded once to float32."""
    for i in range(half.size):
        h = np.int64(half[i])
        e = (h >> 10) & 0x1F
        m = h & 0x3FF
        if e == 31:
            v = np.inf if m == 0 else np.nan
        else:
            v = (m + 1024 if e else m) * pow2[e]
        out[i] += np.float32(-v if h & 0x8000 else v)


@njit(cache=True)
def bf16_encode(bits, out):
    """out[i] = bfloat16(x[i]), round to nearest even."""
    for i in range(bits.size):
        out[i] = bf16_bits(bits[i])


@njit(cache=True)
def fp16_decode(half, out):
    """out[i] = float32 bits of float16 bits half[i] (exact)."""
    for i in range(half.size):
        out[i] = f32_bits_of_f16(half[i])


@njit(cache=True)
def bf16_decode(half, out):
    """out[i] = float32 bits of bfloat16 bits half[i]: its top half (exact)."""
    for i in range(half.size):
        out[i] = np.uint32(half[i]) << np.uint32(16)


# ---------------------------------------------------------------- 1-bit sign, per-chunk scale
@njit(cache=True)
def abs_sum(x, lo, hi):
    """sum |x[i]| over [lo, hi) in float64, as four interleaved partial sums (this order on
    every device, so CPU and GPU scales agree to the bit)."""
    s0 = s1 = s2 = s3 = np.float64(0.0)
    i = lo
    while i + 4 <= hi:
        s0 += abs(x[i])
        s1 += abs(x[i + 1])
        s2 += abs(x[i + 2])
        s3 += abs(x[i + 3])
        i += 4
    while i < hi:
        s0 += abs(x[i])
        i += 1
    return (s0 + s1) + (s2 + s3)


@njit(cache=True)
def _pack_signs(x, lo, hi, packed):
    """Bits of (x[i] >= 0) for i in [lo, hi), lo a multiple of 8: byte i // 8, bit i % 8."""
    full = lo + (hi - lo) // 8 * 8
    for j in range(lo // 8, full // 8):
        base = 8 * j
        v = np.uint8(0)
        for t in range(8):
            v |= np.uint8(x[base + t] >= 0) << np.uint8(t)
        packed[j] = v
    if full < hi:
        v = np.uint8(0)
        for t in range(hi - full):
            v |= np.uint8(x[full + t] >= 0) << np.uint8(t)
        packed[full // 8] = v


@njit(cache=True)
def sign_encode(x, chunk, packed, scales):
    """scale_c = mean |x| over chunk c; bit i = (x[i] >= 0), 8 per byte, bit 0 first.

    Decoded value: +scale or -scale. chunk is a multiple of 8, so bytes never straddle.
    """
    n = x.size
    for c in range(scales.size):
        lo = c * chunk
        hi = min(n, lo + chunk)
        scales[c] = abs_sum(x, lo, hi) / (hi - lo)
    _pack_signs(x, 0, n, packed)


@njit(cache=True)
def sign_encode_feedback(x, r, chunk, packed, scales):
    """Error feedback fused: v = x + r encoded as sign_encode(v) does, r <- v - decoded(v),
    chunk by chunk: one pass, no whole-buffer temporary, the bits of the steps apart."""
    n = x.size
    v = np.empty(chunk, np.float32)
    for c in range(scales.size):
        lo = c * chunk
        hi = min(n, lo + chunk)
        for i in range(hi - lo):
            v[i] = x[lo + i] + r[lo + i]
        sc = np.float32(abs_sum(v, 0, hi - lo) / (hi - lo))
        scales[c] = sc
        _pack_signs(v[:hi - lo], 0, hi - lo, packed[lo // 8:])
        for i in range(hi - lo):
            r[lo + i] = v[i] - sc if v[i] >= 0 else v[i] + sc


@njit(cache=True)
def sign_decode_add(packed, scales, chunk, out):
    """out[i] += (+scale or -scale) of element i."""
    n = out.size
    for j in range(packed.size):
        base = 8 * j
        s = scales[base // chunk]
        v = packed[j]
        for t in range(min(8, n - base)):
            out[base + t] += s if (v >> t) & 1 else -s


# ---------------------------------------------------------------- QSGD, s levels, bit-packed
def qsgd_width(levels: int) -> int:
    """Bits per element: sign + level, rounded up to 2, 4 or 8 so codes never straddle bytes."""
    need = 1 + int(levels).bit_length()
    for w in (2, 4, 8):
        if need <= w:
            return w
    raise ValueError(f"QSGD levels must be in [1, 127], got {levels}")


@njit(cache=True, inline="always")
def _pack(buf, count, codes, first, width):
    """codes[first + j] = buf[j*per] | buf[j*per + 1] << width | ... (per = 8 / width);
    inlined with a constant width, so the loop unrolls and vectorizes."""
    per = 8 // width
    for j in range((count + per - 1) // per):
        v = np.uint32(0)
        for t in range(per):
            v |= buf[j * per + t] << np.uint32(t * width)
        codes[first + j] = v


@njit(cache=True)
def qsgd_encode(x, levels, bucket, width, seed, codes, norms):
    """norm_b = max |x| over bucket b; code = sign | floor(|x|/norm * s + u), u ~ U[0,1)
    from (seed, i); codes packed 8/width per byte, lowest bits first.

    Per bucket: the codes into a small buffer (a vectorizable loop), then packed (bucket is
    a multiple of 8, so a byte lies inside one bucket): twice as fast as packing on the fly.
    """
    n = x.size
    buf = np.zeros(bucket, dtype=np.uint32)
    for b in range(norms.size):
        lo = b * bucket
        hi = min(n, lo + bucket)
        m = np.float32(0.0)
        for i in range(lo, hi):
            m = max(m, abs(x[i]))
        norms[b] = m
        scale = np.float32(levels) / m if m > 0 else np.float32(0.0)
        for i in range(lo, hi):
            buf[i - lo] = qsgd_code(x[i], scale, levels, uniform(seed, i), width)
        for i in range(hi - lo, bucket):
            buf[i] = 0
        first = lo * width // 8
        if width == 2:
            _pack(buf, hi - lo, codes, first, 2)
        elif width == 4:
            _pack(buf, hi - lo, codes, first, 4)
        else:
            _pack(buf, hi - lo, codes, first, 8)


@njit(cache=True)
def qsgd_decode_add(codes, norms, levels, bucket, width, out):
    """out[i] += sign * norm * level / s."""
    n = out.size
    per = 8 // width
    mask = (1 << (width - 1)) - 1
    for j in range(codes.size):
        v = np.int64(codes[j])
        for t in range(min(per, n - j * per)):
            i = j * per + t
            code = (v >> (t * width)) & ((1 << width) - 1)
            q = norms[i // bucket] * (code & mask) / levels
            out[i] += -q if code >> (width - 1) else q


# ---------------------------------------------------------------- random-k (stratified)
@njit(cache=True)
def randomk_indices(n, k, seed, out):
    """One index per stratum [b*n/k, (b+1)*n/k): k distinct, sorted, from (seed, b)."""
    for b in range(k):
        lo = (b * n) // k
        hi = ((b + 1) * n) // k
        out[b] = lo + min(hi - lo - 1, np.int64(uniform(seed, b) * (hi - lo)))


# ---------------------------------------------------------------- top-k by threshold
@njit(cache=True)
def sample_abs(x, seed, out):
    """|x| at out.size pseudo-random positions (a sample for the threshold estimate)."""
    n = x.size
    for j in range(out.size):
        out[j] = abs(x[min(n - 1, np.int64(uniform(seed, j) * n))])


@njit(cache=True)
def collect_above(x, thr, idx):
    """Indices i (ascending) with |x[i]| >= thr into idx; returns how many there are
    (may exceed idx.size: then idx holds the first idx.size of them)."""
    c = 0
    cap = idx.size
    for i in range(x.size):
        if abs(x[i]) >= thr:
            if c < cap:
                idx[c] = i
            c += 1
    return c


@njit(cache=True)
def select_k(x, cand, kth, k, idx, vals):
    """The k largest |x| among candidates, in ascending index order: every |x| > kth, then
    the first ones equal to kth until k are taken."""
    above = 0
    for j in range(cand.size):
        if abs(x[cand[j]]) > kth:
            above += 1
    ties = k - above
    c = 0
    for j in range(cand.size):
        i = cand[j]
        a = abs(x[i])
        if a > kth or (a == kth and ties > 0):
            if a == kth:
                ties -= 1
            idx[c] = i
            vals[c] = x[i]
            c += 1
    return c


@njit(cache=True)
def scatter_add(idx, vals, out):
    """out[idx[j]] += vals[j] (duplicates add up)."""
    for j in range(idx.size):
        out[idx[j]] += vals[j]
