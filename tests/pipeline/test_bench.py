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


@pytest.mark.launcher
@pytest.mark.timeout(200)
def test_bench_pipeline_timed_stages_run_more_stages_than_cores(tmp_path):
    """--compute timed: every stage's forward takes --forward-ms and its backward twice
    that, exactly enough to show in the busy times, with p = 4 on any machine."""
    out = tmp_path / "bench"
    proc = launcher.run(4, [sys.executable, "-m", "mpidist", "bench", "pipeline", "--stages", "4",
                            "--microbatches", "4", "--steps", "1", "--dim", "32", "--rows", "4",
                            "--compute", "timed", "--forward-ms", "2", "--out", str(out)],
                        timeout=180, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "timed waits of 2 ms forward, 4 ms backward" in proc.stdout
    rows = json.loads((out / "pipeline.json").read_text())
    assert [(r["schedule"], r["p"]) for r in rows] == [("gpipe", 4), ("1f1b", 4)]
    for r in rows:
        busy = 4 * (2 + 4)                  # m micro-batches, forward + backward, in ms
        assert all(busy <= b < 3 * busy for b in r["busy_ms"]), r["busy_ms"]
        assert r["ideal_bubble"] == pytest.approx(3 / 7)
        assert r["step_ms"] >= busy / (1 - r["ideal_bubble"]) * 0.99


def test_timed_layer_takes_its_time_and_passes_data_through():
    import time

    import numpy as np

    from mpidist.bench.pipeline import _Timed
    layer = _Timed(3.0)
    x = np.arange(6.0).reshape(2, 3)
    t0 = time.perf_counter()
    y = layer.forward(x)
    t1 = time.perf_counter()
    dx = layer.backward(2 * y)
    t2 = time.perf_counter()
    assert t1 - t0 >= 3e-3 and t2 - t1 >= 6e-3
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(dx, 2 * x)
    assert y is not x and not np.shares_memory(y, x)
