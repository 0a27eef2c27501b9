"""Torch checkpoints in mpidist's HDF5 format: resumed at another rank count and as ZeRO-2,
training continues the same loss curve."""
import json
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="mpidist.torch needs PyTorch (the [torch] extra)")

import mpidist.torch as mt                                          # noqa: E402
from mpidist import launcher                                        # noqa: E402
from mpidist.torch.checkpoint import load_checkpoint, save_checkpoint   # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def model_and_data(size, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2 * size, 8, generator=g), torch.randint(0, 4, (2 * size,), generator=g))
            for _ in range(steps)]
    return model, data


def run(opt, model, data, rank):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[2 * rank:2 * rank + 2]),
                                          y[2 * rank:2 * rank + 2]).backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dp_checkpoint_resumes_as_zero2(comm, shared_dir, dtype):
    model, data = model_and_data(comm.size)
    model = model.to(dtype)
    data = [(x.to(dtype), y) for x, y in data]
    opt = mt.DistributedOptimizer(model, "adamw", lr=1e-2, comm=comm)
    run(opt, model, data[:2], comm.rank)
    path = os.path.join(shared_dir, "ckpt.h5")
    save_checkpoint(path, opt, 2, model=model)
    run(opt, model, data[2:], comm.rank)
    fresh, _ = model_and_data(comm.size)
    fresh = fresh.to(dtype)
    zopt = mt.DistributedOptimizer(fresh, "adamw", lr=1e-2, comm=comm, zero=2)
    assert load_checkpoint(path, zopt, model=fresh) == 2
    assert zopt.optimizer.step_count == 2
    run(zopt, fresh, data[2:], comm.rank)
    np.testing.assert_allclose(zopt.flat_params.astype(np.float32),
                               opt.flat_params.astype(np.float32), rtol=1e-6, atol=1e-7)
    opt.close()
    zopt.close()


def test_torch_optimizer_is_refused(comm, shared_dir):
    model, _ = model_and_data(comm.size)
    opt = mt.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), comm=comm)
    with pytest.raises(TypeError, match="torch.save"):
        save_checkpoint(os.path.join(shared_dir, "x.h5"), opt, 0)
    opt.close()


@pytest.mark.launcher
@pytest.mark.timeout(900)
def test_written_on_4_ranks_resumes_on_3_and_as_zero2_on_2(tmp_path):
    ckpt = str(tmp_path / "ckpt.h5")
    job = os.path.join(HERE, "resume_job.py")
    curves = {}
    for label, n, mode, zero in (("4", 4, "first", 0), ("3", 3, "resume", 0),
                                 ("2z", 2, "resume", 2)):
        out = str(tmp_path / f"{label}.json")
        proc = launcher.run(n, [sys.executable, job, mode, ckpt, str(zero), out], timeout=300,
                            capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(out) as fh:
            curves[label] = {int(k): v for k, v in json.load(fh).items()}
    assert sorted(curves["3"]) == sorted(curves["2z"]) == [3, 4, 5]
    for resumed in ("3", "2z"):
        for step, loss in curves[resumed].items():
            assert abs(loss - curves["4"][step]) <= 1e-6 * abs(curves["4"][step]), \
                (resumed, step, loss, curves["4"][step])
