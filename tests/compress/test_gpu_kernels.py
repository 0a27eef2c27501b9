"""GPU kernels against the CPU ones: in Numba's CUDA simulator (a subprocess with
NUMBA_ENABLE_CUDASIM=1, tiny sizes) everywhere, and with CuPy on a real GPU where one is."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mpidist.compress import CompressedAllreduce, make_compressor
from mpidist.flat import Layout

SIM_SCRIPT = textwrap.dedent("""
    import numpy as np
    from numba import config
    assert config.ENABLE_CUDASIM, "the simulator is not on"
    from mpidist.kernels import compress_cpu as C, compress_gpu as G
    rng = np.random.default_rng(0)
    n = 200
    x = rng.standard_normal(n).astype(np.float32)
    x[:6] = [0.0, -0.0, 1e-30, 7e-8, 65504.0, -3e-5]
    b = x.view(np.uint32)
    def same(name, cpu, gpu, *args, outs):
        a = [np.zeros_like(o) for o in outs]
        g = [np.zeros_like(o) for o in outs]
        cpu(*args, *a)
        gpu(*args, *g)
        for u, v in zip(a, g):
            assert np.array_equal(u, v), (name, u, v)
    for k in (0, 7, -3):
        same("fp16", C.fp16_encode, G.fp16_encode, b, k, outs=[np.empty(n, np.uint16)])
    same("bf16", C.bf16_encode, G.bf16_encode, b, outs=[np.empty(n, np.uint16)])
    halves = np.concatenate([np.arange(0, 1 << 16, 331), [0x0001, 0x03FF, 0x7C00, 0x7E01,
                                                          0xFC00]]).astype(np.uint16)
    same("fp16 decode", C.fp16_decode, G.fp16_decode, halves,
         outs=[np.empty(halves.size, np.uint32)])
    same("bf16 decode", C.bf16_decode, G.bf16_decode, halves,
         outs=[np.empty(halves.size, np.uint32)])
    same("sign", C.sign_encode, G.sign_encode, x, 64,
         outs=[np.empty(-(-n // 8), np.uint8), np.empty(-(-n // 64), np.float32)])
    packed, scales = np.empty(-(-n // 8), np.uint8), np.empty(-(-n // 64), np.float32)
    C.sign_encode(x, 64, packed, scales)
    same("sign decode", C.sign_decode_add, G.sign_decode_add, packed, scales, 64,
         outs=[np.empty(n, np.float32)])
    res = rng.standard_normal(n).astype(np.float32)
    r_cpu, r_gpu = res.copy(), res.copy()
    same("sign feedback", lambda *a: C.sign_encode_feedback(x, r_cpu, 64, *a),
         lambda *a: G.sign_encode_feedback(x, r_gpu, 64, *a),
         outs=[np.empty(-(-n // 8), np.uint8), np.empty(-(-n // 64), np.float32)])
    assert np.array_equal(r_cpu, r_gpu), ("sign feedback residual", r_cpu, r_gpu)
    for levels, width in ((1, 2), (7, 4), (100, 8)):
        same("qsgd", lambda *a: C.qsgd_encode(*a[:5], a[5], a[6]),
             lambda *a: G.qsgd_encode(*a[:5], a[5], a[6]), x, levels, 64, width, 1234,
             outs=[np.empty(-(-n * width // 8), np.uint8), np.empty(-(-n // 64), np.float32)])
        codes, norms = np.empty(-(-n * width // 8), np.uint8), np.empty(-(-n // 64), np.float32)
        C.qsgd_encode(x, levels, 64, width, 1234, codes, norms)
        same("qsgd decode", C.qsgd_decode_add, G.qsgd_decode_add, codes, norms, levels, 64,
             width, outs=[np.empty(n, np.float32)])
    same("randomk", C.randomk_indices, G.randomk_indices, n, 17, 99,
         outs=[np.empty(17, np.int64)])
    same("sample", C.sample_abs, G.sample_abs, x, 99, outs=[np.empty(31, np.float32)])
    thr = np.float32(np.sort(np.abs(x))[-40])
    for cap in (64, 10):                                    # room for all 40, and not
        same("collect", lambda *a: a[-1].__setitem__(0, C.collect_above(*a[:-1])),
             lambda *a: a[-1].__setitem__(0, G.collect_above(*a[:-1])), x, thr,
             np.empty(cap, np.uint32), outs=[np.empty(1, np.int64)])
    xt = np.round(x * 2) / 2                                # ties at the k-th |x|
    cand = np.arange(n, dtype=np.uint32)
    kth = np.float32(np.sort(np.abs(xt))[-25])
    same("select", C.select_k, G.select_k, xt, cand, kth, 25,
         outs=[np.empty(25, np.uint32), np.empty(25, np.float32)])
    assert G.absmax_bits(b) == C.absmax_bits(b) and G.all_finite(b)
    x[3] = np.nan
    assert not G.all_finite(x.view(np.uint32))
    print("cudasim kernels agree")
""")


@pytest.mark.launcher
def test_cuda_kernels_in_the_simulator_match_cpu():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, "-c", SIM_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cudasim kernels agree" in proc.stdout


LAYOUT = Layout([("fc1.weight", (64, 48)), ("fc1.bias", (48,)), ("fc2.weight", (48, 10))])
GPU_CONFIGS = [("fp16", {}), ("bf16", {}), ("topk", {"ratio": 0.02}), ("randomk", {"ratio": 0.05}),
               ("sign", {}), ("qsgd", {"levels": 7}), ("powersgd", {"rank": 2})]


@pytest.mark.gpu
@pytest.mark.parametrize("name,opts", GPU_CONFIGS)
def test_cupy_compressors_match_cpu(name, opts):
    import cupy as cp
    x = np.random.default_rng(3).standard_normal(LAYOUT.numel).astype(np.float32)
    cpu, gpu = make_compressor(name, **opts), make_compressor(name, **opts)
    for _ in range(2):                                     # residual and warm start too
        pc, cc = cpu.compress(x, LAYOUT)
        pg, cg = gpu.compress(cp.asarray(x), LAYOUT)
        yc, yg = cpu.decompress(pc, cc), gpu.decompress(pg, cg)
        assert isinstance(yg, cp.ndarray)
        if name == "powersgd":
            assert np.allclose(yc, yg.get(), atol=1e-4 * np.abs(yc).max())
        else:
            assert all(np.array_equal(a, b.get()) for a, b in zip(pc, pg)), name
            assert np.allclose(yc, yg.get(), rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("name,opts", GPU_CONFIGS)
def test_compressed_allreduce_on_cupy_matches_numpy(comm, name, opts):
    import cupy as cp
    g = np.random.default_rng(comm.rank).standard_normal(LAYOUT.numel).astype(np.float32)
    a = CompressedAllreduce(make_compressor(name, **opts), comm)
    b = CompressedAllreduce(make_compressor(name, **opts), comm)
    out_cpu = a(g, LAYOUT)
    out_gpu = b(cp.asarray(g), LAYOUT)
    assert isinstance(out_gpu, cp.ndarray) and a.bytes_sent == b.bytes_sent
    assert np.allclose(out_cpu, out_gpu.get(), rtol=1e-5, atol=1e-5 * np.abs(out_cpu).max())


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["exact", "sampled"])
def test_cupy_topk_sends_what_numpy_sends(method):
    """Above the size where the sample threshold runs (and with ties at the k-th |x|, and
    a sample that misjudges so the fallback runs), a CuPy gradient sends bit for bit what
    its NumPy copy sends."""
    import cupy as cp
    from mpidist.compress.topk import TopK
    rng = np.random.default_rng(5)
    n = 1 << 20
    normal = rng.standard_normal(n).astype(np.float32)
    tied = np.round(normal * 4) / 4
    spiky = np.zeros(n, np.float32)
    spiky[rng.choice(n, 3000, replace=False)] = rng.standard_normal(3000)
    layout = Layout([("w", (n,))])
    for x in (normal, tied, spiky):
        cpu = TopK(0.01, method=method, error_feedback=False)
        gpu = TopK(0.01, method=method, error_feedback=False)
        (vc, ic), _ = cpu.encode(x, layout)
        (vg, ig), _ = gpu.encode(cp.asarray(x), layout)
        assert np.array_equal(ic, ig.get()) and np.array_equal(vc, vg.get())
        if method == "exact":
            k = cpu.k_of(n)
            assert ic.size == k and np.abs(vc).min() >= np.sort(np.abs(x))[-k]
