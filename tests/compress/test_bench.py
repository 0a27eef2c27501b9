"""`mpidist bench compress` runs end to end at a tiny size on 2 ranks (figures not checked:
benchmarks print, tests assert behaviour; here the behaviour is the report's content)."""
import json
import os
import subprocess
import sys

import pytest

from mpidist.launcher import mpi_env, mpiexec_argv


@pytest.mark.launcher
def test_bench_compress_reports_every_compressor(tmp_path):
    out = tmp_path / "bench"
    argv = [sys.executable, "-m", "mpidist", "bench", "compress", "--numel", "6000",
            "--steps", "1", "--reps", "1", "--out", str(out)]
    # a fresh job: none of this process's own MPI job variables (mpiexec -n 1 pytest)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    proc = subprocess.run(mpiexec_argv(2, argv), env=mpi_env(2, base), capture_output=True,
                          text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    from mpidist.bench.compress import CONFIGS
    for label, _, _ in CONFIGS:
        assert label in proc.stdout
    report = json.loads((out / "compress.json").read_text())
    assert report["ranks"] == 2 and report["numel"] == 6000
    assert report["allreduce"]["fp16"]["wire_ratio"] == pytest.approx(0.5, rel=0.02)
    assert report["allreduce"]["dense fp32 ring"]["wire_ratio"] == 1.0
    assert (out / "compress.csv").exists() and (out / "compress.png").exists()
