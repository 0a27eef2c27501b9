"""End-to-end runs under their own mpiexec: the benchmark and explain CLIs, the
hierarchical algorithm on 2 simulated nodes x 3 ranks (6 ranks), and a 1 GiB message
through every algorithm."""
import json
import os
import sys

import pytest

from mpidist.launcher import run, without_job_variables

SIX = """
import hashlib
import numpy as np
from mpidist.comm import Communicator
from mpidist.collectives import allreduce
c = Communicator(ranks_per_node=3)
assert (c.num_nodes, c.local_size) == (2, 3)
bad = 0
for n in (1, 5, 6, 7, 1000, 4099):
    for op in ("sum", "avg", "max"):
        x = np.random.default_rng([c.rank, n]).integers(-9, 9, n).astype(np.float64)
        ref = allreduce(x, op=op, algorithm="native", comm=c, out=np.empty_like(x))
        got = allreduce(x, op=op, algorithm="hierarchical", comm=c, out=np.empty_like(x))
        bad += not np.array_equal(got, ref)
hashes = c.comm.allgather(hashlib.sha256(got.tobytes()).hexdigest())
assert bad == 0 and len(set(hashes)) == 1, (bad, hashes)
if c.rank == 0:
    print("HIER-2x3-OK")
"""

GIB = """
import numpy as np
from mpi4py import MPI
from mpidist.collectives import ALGORITHMS, allreduce
from mpidist.comm import Communicator
x = np.empty((1 << 30) // 4, np.float32)
n, p, r = x.size, MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank
marks = np.array([0, n // 2 - 1, n // 2, n - 1])   # ends and the middle chunk boundary
bad = []
for alg in ALGORITHMS:
    c = Communicator()                 # freed after each: scratch and windows go with it
    x.fill(1.0)
    x[marks] = r
    allreduce(x, algorithm=alg, comm=c)
    wrong = np.count_nonzero(x[marks] != p * (p - 1) / 2)
    x[marks] = p
    wrong += np.count_nonzero(x != p)
    if c.comm.allreduce(wrong):
        bad.append(alg)
    c.free()
assert not bad, bad
if r == 0:
    print("ONE-GIB-OK")
"""


def _run(n, argv, tmp_path, extra_env=None):
    # a pytest started by mpiexec -n 1 must not hand its own job's identity to the child
    base = without_job_variables(os.environ)
    base["MPIDIST_CACHE_DIR"] = str(tmp_path / "cache")
    base.update(extra_env or {})
    return run(n, argv, timeout=240, env=base, capture_output=True, text=True, cwd=tmp_path)


@pytest.mark.launcher
def test_hierarchical_two_nodes_of_three(tmp_path):
    res = _run(6, [sys.executable, "-c", SIX], tmp_path)
    assert res.returncode == 0 and "HIER-2x3-OK" in res.stdout, \
        f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"


@pytest.mark.launcher
def test_one_gibibyte_through_every_algorithm(tmp_path):
    res = _run(2, [sys.executable, "-c", GIB], tmp_path)
    assert res.returncode == 0 and "ONE-GIB-OK" in res.stdout, \
        f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"


@pytest.mark.launcher
def test_an_error_on_one_rank_ends_the_whole_job(tmp_path):
    """Only rank 0 writes the bench's files: its failure must end the job, not leave rank 1
    waiting in a collective (MPI_Abort from the CLI, whatever the launcher does)."""
    res = _run(2, [sys.executable, "-m", "mpidist", "bench", "allreduce", "--sizes", "8",
                   "--algorithms", "native", "--reps", "1", "--no-refit",
                   "--out", os.devnull + "/bench"], tmp_path)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "unexpected error on rank 0, aborting the job" in res.stderr, res.stderr


@pytest.mark.launcher
def test_bench_and_explain_cli(tmp_path):
    out = tmp_path / "bench"
    res = _run(2, [sys.executable, "-m", "mpidist", "bench", "allreduce", "--sizes", "8,64K",
                   "--algorithms", "native,textbook,ring,auto", "--reps", "2",
                   "--seconds", "0.05", "--out", str(out)], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "busbw GB/s" in res.stdout and "auto [" in res.stdout and "summary:" in res.stdout
    assert "the model's choice alone, without the trials: worst" in res.stdout
    data = json.loads((out / "allreduce.json").read_text())
    assert len(data["rows"]) == 8 and all(r["ok"] for r in data["rows"])
    steady = data["steadiness"]                 # before the sweep and after each size
    assert len(steady["samples_s"]) == 3 and 0 < steady["min_s"] <= steady["max_s"]
    assert "machine steadiness:" in res.stdout
    assert (out / "allreduce.png").stat().st_size > 0 and (out / "allreduce.csv").exists()
    res = _run(2, [sys.executable, "-m", "mpidist", "bench", "allreduce", "--sizes", "6K",
                   "--dtype", "bfloat16", "--algorithms", "textbook,ring,auto", "--reps", "2",
                   "--seconds", "0.05", "--no-refit", "--out", str(out)], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((out / "allreduce.json").read_text())
    assert "; bfloat16;" in data["header"] and all(r["ok"] for r in data["rows"])
    assert {r["bytes"] for r in data["rows"]} == {6 << 10}
    res = _run(2, [sys.executable, "-m", "mpidist", "explain", "--sizes", "4K", "--reps", "1"],
               tmp_path)
    assert res.returncode == 0 and "predicted ms" in res.stdout, res.stdout + res.stderr
    marked = [line for line in res.stdout.splitlines() if "<-" in line]
    assert 1 <= len(marked) <= 2, res.stdout           # the model's choice and auto's pick
    assert any("model" in m for m in marked) and any("auto" in m for m in marked)
    assert os.listdir(tmp_path / "cache")
    res = _run(2, [sys.executable, "-m", "mpidist", "info"], tmp_path)
    assert res.returncode == 0 and "MPI library" in res.stdout, res.stdout + res.stderr
    assert "allreduce auto  cost model cached at" in res.stdout, res.stdout
    assert "remembered pick; on-line trials on" in res.stdout, res.stdout
