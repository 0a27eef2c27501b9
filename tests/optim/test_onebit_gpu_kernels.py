"""The 1-bit optimizers' GPU kernels give what their CPU kernels give (which equal the NumPy
reference: test_onebit) through the warm-up and the compression stage: numba.cuda under
Numba's CUDA simulator in a subprocess (tiny sizes), CuPy and numba.cuda on a real GPU."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mpidist.flat import Layout
from mpidist.optim import build_optimizer

CASES = [("onebit_adam", {"weight_decay": 0.1, "exclude": ("*bias",)}),
         ("onebit_lamb", {"weight_decay": 0.01}),
         ("onebit_lamb", {"precondition": False, "bias_correction": False})]


def twin_run(layout, name, hyper, backend, to_device, to_host, steps=8, freeze=3, seed=4):
    """Step a CPU optimizer and a `backend` one on the same inputs; in the compression stage
    both take the same momentum (what the exchange would give) and form the same local
    momentum. Returns [(what, cpu array, device array as host)] to compare."""
    cpu = build_optimizer(name, layout, lr=0.01, freeze_step=freeze, **hyper)
    dev = build_optimizer(name, layout, lr=0.01, freeze_step=freeze, backend=backend, **hyper)
    rng = np.random.default_rng(seed)
    n = layout.numel
    p = rng.standard_normal(n).astype(np.float32)
    q = to_device(p)
    pairs = []
    for _ in range(steps):
        g = (rng.standard_normal(n) * 0.05).astype(np.float32)
        g[:3] = 0                      # v = 0 there: masked in the compression stage
        if not cpu.frozen:
            a, b = cpu.step(p, g), dev.step(q, to_device(g))
        else:
            m = cpu.state_buffers()["exp_avg"] + (rng.standard_normal(n) * 1e-3).astype(np.float32)
            den = cpu.frozen_denominator(cpu.state_buffers()["exp_avg_sq"])
            dden = dev.frozen_denominator(dev.state_buffers()["exp_avg_sq"])
            local, dlocal = g.copy(), to_device(g)
            cpu.local_momentum(m, local, den, 3.0)
            dev.local_momentum(to_device(m), dlocal, dden, 3.0)
            pairs.append(("local momentum", local, to_host(dlocal)))
            a, b = cpu.step(p, m), dev.step(q, to_device(m))
        if a.trust_ratios is not None:
            pairs.append(("coefficients", a.trust_ratios, b.trust_ratios))
    pairs.append(("params", p, to_host(q)))
    for k, v in cpu.state_buffers().items():
        pairs.append((k, v, to_host(dev.state_buffers()[k])))
    return pairs


SIM_SCRIPT = textwrap.dedent("""
    import numpy as np
    from numba import config
    from mpidist.flat import Layout
    from tests.optim.test_onebit_gpu_kernels import twin_run
    assert config.ENABLE_CUDASIM
    layout = Layout([("fc.weight", (5, 7)), ("fc.bias", (7,)), ("out.weight", (7, 2))])
    for name, hyper in {cases!r}:
        for what, want, got in twin_run(layout, name, hyper, "numba-cuda", np.array, np.asarray):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=what)
        print("ok", name, flush=True)
""")


@pytest.mark.launcher
def test_numba_cuda_kernels_in_simulator(tmp_path):
    from mpidist.launcher import mpi_env
    env = mpi_env(1)
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    root = str(Path(__file__).resolve().parents[2])     # the script imports twin_run from here
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    script = tmp_path / "sim.py"
    script.write_text(SIM_SCRIPT.format(cases=CASES))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=170, cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ok ") == len(CASES), out.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba-cuda"])
@pytest.mark.parametrize("name,hyper", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_gpu_kernels_equal_cpu_kernels(backend, name, hyper):
    import cupy as cp
    layout = Layout([("emb.weight", (300, 200)), ("fc.weight", (64, 33)), ("fc.bias", (33,)),
                     ("ln.weight", (33,))])
    for what, want, got in twin_run(layout, name, hyper, backend, cp.asarray,
                                    lambda a: a.get(), steps=40, freeze=10):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=what)
