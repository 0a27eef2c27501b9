"""Each experiment's --quick mode runs and writes its table, plot and section.

Launcher tests (the single-rank session): the experiments start their own ranks, with
mpidist.launcher or on the simulated cluster (those skip where namespaces cannot be made).
"""
import csv
import os
import subprocess
import sys

import pytest

from mpidist.launcher import mpi_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# name: (needs the simulated cluster, a column every row must fill)
EXPERIMENTS = {
    "architectures": (True, "step_s"),
    "centralized": (True, "overhead_s_per_step"),
    "consistency": (False, "final_accuracy"),
    "large_batch": (False, "test_accuracy"),
    "compression": (False, "bytes_per_step"),
    "diloco": (True, "val_loss"),
}


@pytest.mark.launcher
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_quick_mode_writes_table_plot_and_section(name, tmp_path):
    cluster, column = EXPERIMENTS[name]
    if cluster:
        from mpidist.simcluster import unavailable_reason
        reason = unavailable_reason()
        if reason is not None:
            pytest.skip(f"runs on the simulated cluster, which cannot be made here: {reason}")
    doc = os.path.join(REPO, "docs", "EXPERIMENTS.md")
    before = open(doc).read() if os.path.exists(doc) else None
    proc = subprocess.run([sys.executable, "-m", f"experiments.{name}", "--quick", "--out",
                           str(tmp_path)], cwd=REPO, env=mpi_env(1), capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(tmp_path / f"{name}.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert rows and all(r[column] not in ("", None) for r in rows)
    assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    section = (tmp_path / f"{name}.md").read_text()
    for part in ("**Claim.**", "**Setup.**", "**Command.**", "**Verdict.**", f"{name}.png"):
        assert part in section, part
    # --quick never rewrites the committed document
    assert (open(doc).read() if os.path.exists(doc) else None) == before
