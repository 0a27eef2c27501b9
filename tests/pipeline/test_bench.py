"""`mpidist bench pipeline` runs under mpiexec, prints its table and writes CSV, JSON and
timeline PNGs (figures are the benchmark's business; here only their shape and the memory
bound, which does not depend on timing)."""
import json
import sys

import pytest

from mpidist import launcher


@pytest.mark.launcher
@pytest.mark.timeout(200)
def test_bench_pipeline_writes_table_and_timelines(tmp_path):
    out = tmp_path / "bench"
    proc = launcher.run(2, [sys.executable, "-m", "mpidist", "bench", "pipeline", "--stages", "2,4",
                            "--microbatches", "4", "--steps", "1", "--dim", "32", "--rows", "4",
                            "--out", str(out)],
                        timeout=180, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ideal  replay  bubble" in proc.stdout and "p = 4 skipped" in proc.stdout
    assert "# p = 2: machine steadiness:" in proc.stdout
    rows = json.loads((out / "pipeline.json").read_text())
    assert [(r["schedule"], r["p"], r["m"]) for r in rows] == [("gpipe", 2, 4), ("1f1b", 2, 4)]
    gpipe, f1b = rows
    assert gpipe["peak_in_flight"] == [4, 4] and gpipe["peak_microbatches"] == pytest.approx(4)
    assert f1b["peak_in_flight"] == [2, 1] and f1b["peak_microbatches"] <= 2
    assert gpipe["ideal_bubble"] == pytest.approx(1 / 5)
    assert all(0 <= r["bubble"] < 1 and 0 <= r["replay_bubble"] < 1 for r in rows)
    assert (out / "pipeline.csv").read_text().count("\n") == 3
    for name in ("gpipe", "1f1b"):
        assert (out / f"timeline_{name}_p2_m4.png").stat().st_size > 5_000
