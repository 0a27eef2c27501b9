"""`mpidist bench torch --model gpt` runs end to end at a tiny size on 2 ranks (figures not
checked: benchmarks print, tests assert behaviour; here the report's rows)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="mpidist bench torch needs PyTorch (the [torch] extra)")

from mpidist.launcher import without_job_variables      # noqa: E402


@pytest.mark.launcher
@pytest.mark.timeout(400)
def test_bench_torch_gpt_reports_every_variant(tmp_path):
    out = tmp_path / "bench"
    argv = [sys.executable, "-m", "mpidist", "bench", "torch", "--model", "gpt", "--ranks", "2",
            "--steps", "1", "--warmup", "0", "--batch", "2", "--out", str(out)]
    # a fresh job: none of this process's own MPI job variables (mpiexec -n 1 pytest)
    proc = subprocess.run(argv, env=without_job_variables(os.environ), timeout=360,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "GPT (4 layers, dim 256" in proc.stdout
    (row,) = json.loads((out / "torch.json").read_text())["rows"]
    from mpidist.torch.models import GPT
    assert row["ranks"] == 2 and row["params"] == sum(p.numel() for p in GPT().parameters())
    for variant in ("torch", "ddp", "mpidist", "zero2"):
        assert row[variant]["samples_per_s"] > 0
