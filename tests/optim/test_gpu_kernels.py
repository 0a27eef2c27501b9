"""The GPU kernels against the NumPy reference.

numba.cuda kernels: under Numba's CUDA simulator, in a subprocess that sets
NUMBA_ENABLE_CUDASIM=1 before numba is imported (tiny sizes: the simulator runs each thread
in Python). CuPy and numba.cuda kernels on CuPy arrays: on a real GPU (marked gpu)."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mpidist.flat import Layout
from mpidist.optim import build_optimizer
from mpidist.optim.reference import Reference

CASES = [("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}),
         ("sgd", {}),
         ("adamw", {"amsgrad": True, "exclude": ("*bias",)}),
         ("lars", {"lr": 0.5}),
         ("lamb", {"weight_decay": 0.01, "phi_clamp": (0.0, 2.0)})]

SIM_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from mpidist.flat import Layout
    from mpidist.optim import build_optimizer
    from mpidist.optim.reference import Reference
    from numba import config
    assert config.ENABLE_CUDASIM
    layout = Layout([("fc.weight", (5, 7)), ("fc.bias", (7,)), ("ln.weight", (3,)),
                     ("out.weight", (7, 2))])
    cases = {cases!r}
    for name, hyper in cases:
        opt = build_optimizer(name, layout, backend="numba-cuda", **hyper)
        ref = Reference(opt)
        rng = np.random.default_rng(3)
        p = rng.standard_normal(layout.numel).astype(np.float32)
        q = p.copy()
        for _ in range(3):
            g = rng.standard_normal(layout.numel).astype(np.float32)
            info = opt.step(p, g)
            _, trust = ref.step(q, g)
            if trust is not None:
                np.testing.assert_allclose(info.trust_ratios, trust, rtol=1e-9)
        np.testing.assert_allclose(p, q, rtol=1e-6, atol=0, err_msg=name)
        for k, v in ref.state.items():
            np.testing.assert_allclose(opt.state_buffers()[k], v, rtol=1e-6, atol=0, err_msg=k)
        g[4] = np.inf
        assert opt.step(p, g).skipped
        print("ok", name, flush=True)
""")


@pytest.mark.launcher
def test_numba_cuda_kernels_in_simulator(tmp_path):
    from mpidist.launcher import mpi_env
    env = mpi_env(1)
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    script = tmp_path / "sim.py"
    script.write_text(SIM_SCRIPT.format(cases=CASES))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=170)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ok ") == len(CASES), out.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba-cuda"])
@pytest.mark.parametrize("name,hyper", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_gpu_kernels_equal_reference(backend, name, hyper):
    import cupy as cp
    layout = Layout([("emb.weight", (300, 200)), ("fc.weight", (64, 33)), ("fc.bias", (33,)),
                     ("ln.weight", (33,))])
    opt = build_optimizer(name, layout, backend=backend, **hyper)
    ref = Reference(opt)
    rng = np.random.default_rng(5)
    q = rng.standard_normal(layout.numel).astype(np.float32)
    p = cp.asarray(q)
    for _ in range(100):
        g = rng.standard_normal(layout.numel).astype(np.float32)
        info = opt.step(p, cp.asarray(g))
        _, trust = ref.step(q, g)
        if trust is not None:
            np.testing.assert_allclose(info.trust_ratios, trust, rtol=1e-9)
    np.testing.assert_allclose(p.get(), q, rtol=1e-6, atol=1e-7)
    for k, v in ref.state.items():
        np.testing.assert_allclose(opt.state_buffers()[k].get(), v, rtol=1e-6, atol=1e-7,
                                   err_msg=k)


@pytest.mark.gpu
def test_gpu_fp16_master_weights():
    import cupy as cp
    layout = Layout([("fc.weight", (64, 33)), ("fc.bias", (33,))])
    opt = build_optimizer("adamw", layout)
    ref = Reference(opt)
    rng = np.random.default_rng(6)
    q = rng.standard_normal(layout.numel).astype(np.float16)
    p = cp.asarray(q)
    for _ in range(20):
        g = (rng.standard_normal(layout.numel) * 64).astype(np.float16)
        opt.step(p, cp.asarray(g), loss_scale=64.0)
        ref.step(q, g, loss_scale=64.0)
    np.testing.assert_allclose(opt.state_buffers()["master"].get(), ref.master, rtol=1e-6,
                               atol=1e-7)
    assert p.dtype == np.float16
