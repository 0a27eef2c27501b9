"""`mpidist bench compress` runs end to end at a tiny size on 2 ranks (figures not checked:
benchmarks print, tests assert behaviour; here the behaviour is the report's content)."""
import json
import os
import sys

import pytest

from mpidist.launcher import run, without_job_variables


@pytest.mark.launcher
def test_bench_compress_reports_every_compressor(tmp_path):
    out = tmp_path / "bench"
    argv = [sys.executable, "-m", "mpidist", "bench", "compress", "--numel", "6000",
            "--steps", "1", "--reps", "1", "--out", str(out)]
    # a fresh job: none of this process's own MPI job variables (mpiexec -n 1 pytest)
    base = without_job_variables(os.environ)
    proc = run(2, argv, timeout=170, env=base, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    from mpidist.bench.compress import CONFIGS
    for label, _, _ in CONFIGS:
        assert label in proc.stdout
    report = json.loads((out / "compress.json").read_text())
    assert report["ranks"] == 2 and report["numel"] == 6000
    assert report["allreduce"]["fp16"]["wire_ratio"] == pytest.approx(0.5, rel=0.02)
    assert report["allreduce"]["dense fp32 ring"]["wire_ratio"] == 1.0
    assert (out / "compress.csv").exists() and (out / "compress.png").exists()


def test_time_to_accuracy_reads_the_first_eval_within(tmp_path, comm):
    """Epochs and step seconds until the first evaluation at the target; (None, None) if
    none; the table shows the gap and '-' for never."""
    from mpidist.bench.tta import table, time_to
    path = tmp_path / f"metrics{comm.rank}.jsonl"
    recs = [{"event": "step", "t_step": 0.5}, {"event": "eval", "epoch": 0, "accuracy": 0.90},
            {"event": "step", "t_step": 0.25}, {"event": "eval", "epoch": 1, "accuracy": 0.97},
            {"event": "step", "t_step": 1.0}, {"event": "eval", "epoch": 2, "accuracy": 0.98}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert time_to(str(path), 0.965, comm) == (2, 0.75)
    assert time_to(str(path), 0.99, comm) == (None, None)
    row = {"test_accuracy": 0.9415, "gap_pp": -3.62, "epochs": 12, "train_s": 5.0,
           "epochs_to_within": None, "seconds_to_within": None, "options": {"ratio": 0.01}}
    text = "\n".join(table("job.toml", {"topk 1%": row}, 3.0))
    assert "compressed runs get 3x the epochs" in text
    assert "94.15   -3.62      12                -        -" in text
    assert 'topk 1%: {"ratio": 0.01}' in text


def test_time_to_accuracy_gives_compressed_runs_the_budget(tmp_path, comm, monkeypatch):
    """The uncompressed reference trains the job's epochs; each compressed run trains
    budget times as many, and is measured against that reference."""
    from mpidist.bench import tta
    monkeypatch.setattr(tta, "CONFIGS", [("fp16", "fp16", {})])
    monkeypatch.setattr(tta, "OPTIMIZERS", [("1-bit", "onebit_lamb", {"compressor": "sign"})])
    out = comm.comm.bcast(str(tmp_path) if comm.rank == 0 else None, root=0)
    job = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "digits_lamb.toml")
    rows = tta.run(comm, job, out, {"job.epochs": 1, "checkpoint.interval": 0}, budget=2.0)
    assert rows["uncompressed"]["epochs"] == 1 and rows["fp16"]["epochs"] == 2
    ref = rows["uncompressed"]["test_accuracy"]
    assert rows["fp16"]["gap_pp"] == pytest.approx(100 * (rows["fp16"]["test_accuracy"] - ref))
    # an optimizer row: the job's hyper kept, freeze_step a fraction of the reference's steps
    steps = rows["uncompressed"]["epochs"] * 11          # digits: 11 steps per epoch
    assert rows["1-bit"]["epochs"] == 2 and "error" not in rows["1-bit"]
    assert rows["1-bit"]["options"] == {"optim": "onebit_lamb", "weight_decay": 0.01,
                                        "compressor": "sign",
                                        "freeze_step": round(tta.FREEZE * steps)}
