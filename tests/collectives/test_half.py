"""The half precision casts around the float32 accumulators (ops.widen / ops.narrow)
against NumPy's own casts, bit for bit."""
import ml_dtypes
import numpy as np
import pytest

from mpidist.collectives.ops import narrow, widen

HALF = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_widen_is_numpys_cast_for_every_half_value(dtype):
    every = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    got = np.full(every.size, 7.0, np.float32)
    widen(every, got)
    assert np.array_equal(got.view(np.uint32), every.astype(np.float32).view(np.uint32))


def _float32_probes() -> np.ndarray:
    """Random bit patterns, and every pattern near the float16 rounding edges: the
    largest finite value, the normal/subnormal boundary, the smallest subnormal."""
    rng = np.random.default_rng(0)
    near = [0x477FF000, 0x38800000, 0x33000000, 0x3F800000, 0x7F800000]
    around = [np.arange(c - 4096, c + 4096, dtype=np.int64) for c in near]
    bits = np.concatenate([rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64)] + around)
    bits = bits.astype(np.uint32)
    return np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_narrow_rounds_as_numpy_does(dtype):
    wide = _float32_probes()
    got = np.zeros(wide.size, dtype)
    narrow(wide, got)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = wide.astype(dtype)
    nan = np.isnan(wide)
    assert np.array_equal(got[~nan].view(np.uint16), ref[~nan].view(np.uint16))
    assert np.isnan(got[nan].astype(np.float32)).all()
