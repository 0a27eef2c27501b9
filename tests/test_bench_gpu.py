"""`mpidist bench gpu`: a clear refusal without a GPU; on a GPU, every phase reports at a
tiny size, on 2 ranks (figures not checked: benchmarks print, tests assert behaviour)."""
import json
import os
import sys

import pytest

from mpidist.kernels.backend import gpu_available
from mpidist.launcher import run, without_job_variables


def _bench(tmp_path, *extra):
    argv = [sys.executable, "-m", "mpidist", "bench", "gpu", "--numel", "20000", "--reps", "2",
            "--sizes", "4K,64K", "--out", str(tmp_path), *extra]
    return run(2, argv, timeout=170, env=without_job_variables(os.environ),
               capture_output=True, text=True)


@pytest.mark.launcher
@pytest.mark.skipif(gpu_available(), reason="checks the refusal on a machine without a GPU")
def test_bench_gpu_refuses_without_a_gpu(tmp_path):
    proc = _bench(tmp_path)
    assert proc.returncode == 2
    assert "needs CuPy and a CUDA GPU on every rank" in proc.stdout
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.launcher
@pytest.mark.gpu
def test_bench_gpu_reports_every_phase(tmp_path):
    proc = _bench(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    from mpidist.bench.compress import CONFIGS as COMPRESSORS
    from mpidist.bench.optim import CONFIGS as OPTIMIZERS
    for name, _ in OPTIMIZERS:
        for backend in ("cupy", "numba-cuda"):
            assert report["optim"]["rows"][f"{name} ({backend})"]["GBps"] > 0
    assert {label for label, _, _ in COMPRESSORS} <= set(report["compress"]["rows"])
    rows = report["allreduce"]["rows"].values()
    assert len(rows) == 2 * 4 and all(r["cupy_ok"] and r["numpy_ok"] for r in rows)


def test_bad_sizes_are_a_usage_error(capsys):
    """A size that does not parse stops the bench before it starts, with argparse's message
    (no traceback), on any machine."""
    from mpidist.bench.gpu import main
    with pytest.raises(SystemExit) as exc:
        main(["--sizes", "4K,4Q"])
    assert exc.value.code == 2 and "not a size: '4Q'" in capsys.readouterr().err
