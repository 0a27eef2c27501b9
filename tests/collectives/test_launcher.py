"""End-to-end runs under their own mpiexec: the benchmark, tune and explain CLIs, auto's
bits from one process to the next, the hierarchical algorithm on 2 simulated nodes x 3
ranks (6 ranks), and a 1 GiB message through every algorithm."""
import json
import os
import re
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


AUTO = """
import hashlib
import numpy as np
from mpidist.comm import Communicator
from mpidist.collectives import allreduce
c = Communicator()
digest = hashlib.sha256()
for n in (3, 1000, 70001, 300007):          # below and above the rule's small-message size
    x = np.random.default_rng([c.rank, n]).standard_normal(n).astype(np.float32)
    allreduce(x, comm=c)                    # algorithm="auto"
    digest.update(x.tobytes())
hashes = c.comm.allgather(digest.hexdigest())
assert len(set(hashes)) == 1, hashes
if c.rank == 0:
    print("AUTO-BITS", hashes[0])
"""


def _run(n, argv, tmp_path, extra_env=None):
    # a pytest started by mpiexec -n 1 must not hand its own job's identity to the child
    base = without_job_variables(os.environ)
    base.pop("MPIDIST_ALGORITHM_TABLE", None)
    base.update(extra_env or {})
    return run(n, argv, timeout=240, env=base, capture_output=True, text=True, cwd=tmp_path)


@pytest.mark.launcher
def test_auto_gives_the_same_bits_in_two_fresh_processes(tmp_path):
    """No table: auto's rule alone decides, so two runs at 3 ranks agree bit for bit."""
    bits = []
    for k in range(2):
        (tmp_path / str(k)).mkdir()
        res = _run(3, [sys.executable, "-c", AUTO], tmp_path / str(k))
        assert res.returncode == 0 and "AUTO-BITS" in res.stdout, \
            f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
        bits.append(res.stdout.split("AUTO-BITS")[1].split()[0])
    assert bits[0] == bits[1]


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
                   "--algorithms", "native", "--reps", "1",
                   "--out", os.devnull + "/bench"], tmp_path)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "unexpected error on rank 0, aborting the job" in res.stderr, res.stderr


@pytest.mark.launcher
def test_bench_and_info_cli(tmp_path):
    out = tmp_path / "bench"
    res = _run(2, [sys.executable, "-m", "mpidist", "bench", "allreduce", "--sizes", "8,64K",
                   "--algorithms", "native,textbook,ring,auto", "--reps", "2",
                   "--seconds", "0.05", "--out", str(out)], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "busbw GB/s" in res.stdout and "auto [" in res.stdout and "summary:" in res.stdout
    assert "auto: built-in rule" in res.stdout
    data = json.loads((out / "allreduce.json").read_text())
    assert len(data["rows"]) == 8 and all(r["ok"] for r in data["rows"])
    assert [r["pick"] for r in data["rows"] if r["algorithm"] == "auto"] == ["native"] * 2
    assert "model" not in res.stdout and not any("model" in k for k in [*data, *data["rows"][0]])
    steady = data["steadiness"]                 # before the sweep and after each size
    assert len(steady["samples_s"]) == 3 and 0 < steady["min_s"] <= steady["max_s"]
    assert "machine steadiness:" in res.stdout
    assert (out / "allreduce.png").stat().st_size > 0 and (out / "allreduce.csv").exists()
    res = _run(2, [sys.executable, "-m", "mpidist", "bench", "allreduce", "--sizes", "6K",
                   "--dtype", "bfloat16", "--algorithms", "textbook,ring,auto", "--reps", "2",
                   "--seconds", "0.05", "--out", str(out)], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((out / "allreduce.json").read_text())
    assert "; bfloat16;" in data["header"] and all(r["ok"] for r in data["rows"])
    assert {r["bytes"] for r in data["rows"]} == {6 << 10}
    res = _run(2, [sys.executable, "-m", "mpidist", "info"], tmp_path)
    assert res.returncode == 0 and "MPI library" in res.stdout, res.stdout + res.stderr
    from mpidist import mpilib      # the family, the ABI mpi4py was built for, the library file
    assert re.search(rf"MPI family / ABI +{mpilib.family()} / {re.escape(mpilib.abi())} \(/", res.stdout), res.stdout
    assert re.search(r"allreduce auto +built-in rule \(native up to 256K", res.stdout), res.stdout


@pytest.mark.launcher
def test_tune_then_explain_and_bench_follow_the_table(tmp_path):
    table = tmp_path / "table.json"
    res = _run(2, [sys.executable, "-m", "mpidist", "tune", "--sizes", "1K,64K", "--reps", "1",
                   "--out", str(table)], tmp_path)
    assert res.returncode == 0 and f"wrote {table}" in res.stdout, res.stdout + res.stderr
    doc = json.loads(table.read_text())
    (entry,) = doc["layouts"]
    assert (entry["ranks"], entry["nodes"]) == (2, 1) and doc["made"]["by"] == "mpidist tune"
    picks = [m["pick"] for m in entry["measured"]]
    res = _run(2, [sys.executable, "-m", "mpidist", "explain", "--sizes", "1K,64K", "--reps", "1",
                   "--table", str(table)], tmp_path)
    assert res.returncode == 0 and f"# auto: table {table}" in res.stdout, \
        res.stdout + res.stderr
    autos = [line.split()[1] for line in res.stdout.splitlines() if "table row " in line]
    assert autos == picks, res.stdout                  # the table's pick, at each size
    assert res.stdout.count("tuned at ") == 2 and "model" not in res.stdout, res.stdout
    out = tmp_path / "bench"
    res = _run(2, [sys.executable, "-m", "mpidist", "bench", "allreduce", "--sizes", "1K,64K",
                   "--algorithms", "native,ring,auto", "--reps", "2", "--seconds", "0.05",
                   "--table", str(table), "--out", str(out)], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [r for r in json.loads((out / "allreduce.json").read_text())["rows"]
            if r["algorithm"] == "auto"]
    assert [r["pick"] for r in rows] == picks
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    res = _run(2, [sys.executable, "-c", "import numpy as np; from mpidist.collectives import "
                   "allreduce; allreduce(np.ones(4, np.float32))"], tmp_path,
               {"MPIDIST_ALGORITHM_TABLE": str(bad)})
    assert res.returncode != 0 and res.stderr.count(f"allreduce algorithm table {bad}") >= 2, \
        res.stderr                                     # raised on both ranks
