"""The torch jobs run: the plain script learns, the GPT checkpoints and resumes elsewhere."""
import os
import sys

import pytest

pytest.importorskip("torch", reason="the torch jobs need PyTorch (the [torch] extra)")

from mpidist import launcher      # noqa: E402

JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "jobs")


@pytest.mark.launcher
def test_torch_existing_learns():
    proc = launcher.run(1, [sys.executable, os.path.join(JOBS, "torch_existing.py")],
                        timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout.split("test accuracy")[-1]) > 0.9


@pytest.mark.launcher
@pytest.mark.timeout(600)
def test_torch_gpt_resumes_on_another_rank_count_as_zero2(tmp_path):
    tiny = ["--dim", "32", "--layers", "1", "--heads", "2", "--block", "16", "--batch", "4",
            "--ckpt", str(tmp_path), "--ckpt-every", "2"]
    job = os.path.join(JOBS, "torch_gpt.py")
    first = launcher.run(2, [sys.executable, job, "--steps", "4", *tiny], timeout=300,
                         capture_output=True, text=True)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    again = launcher.run(3, [sys.executable, job, "--steps", "6", "--resume", "--zero", "2",
                             *tiny], timeout=300, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "from step 4" in again.stdout and "step 6 loss" in again.stdout
