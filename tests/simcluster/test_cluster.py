"""The simulated cluster: network namespaces as nodes, real TCP links between them.

The launcher-marked tests build a 2 nodes x 2 ranks cluster (root and iproute2 needed; they
skip with the reason elsewhere) and run tests/simcluster/cluster_check.py on it."""
import json
import os
import subprocess
import sys
import time

import pytest

from mpidist import simcluster
from mpidist.simcluster import SimCluster, parse_rate

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _need_namespaces():
    reason = simcluster.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no simulated cluster here: {reason}")


def test_rates_parse_in_tc_syntax():
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("100mbit") == 1e8
    assert parse_rate("2.5mbit") == 2.5e6
    assert parse_rate(None) is None and parse_rate("none") is None
    for bad in ("1gb", "fast", "-1mbit", "0mbit"):
        with pytest.raises(ValueError, match="bandwidth"):
            parse_rate(bad)


def test_shape_is_checked_before_anything_is_made():
    with pytest.raises(ValueError, match="nodes must be a positive int"):
        SimCluster(0, 2)
    with pytest.raises(ValueError, match="ranks_per_node"):
        SimCluster(2, 1.5)
    with pytest.raises(ValueError, match="250 nodes"):
        SimCluster(300, 1)


def test_without_root_start_fails_with_the_reason(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    cluster = SimCluster(2, 1)
    with pytest.raises(RuntimeError, match="needs root"):
        cluster.start()
    assert cluster.workdir is None


def test_threads_per_rank_share_the_cores_among_every_node_s_ranks(monkeypatch):
    """The simulated nodes run on this machine's cores: Numba's threads per rank are the
    cores over all the ranks started, not over one node's, and each rank counts them all on
    its cores."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    cluster = SimCluster(2, 1)
    cluster.agent = "agent.sh"              # what start() writes; env() only names it
    assert cluster.env()["NUMBA_NUM_THREADS"] == "2"
    assert cluster.env(np=1)["NUMBA_NUM_THREADS"] == "4"
    assert cluster.env()["MPIDIST_MACHINE_RANKS"] == "2"         # each rank: 2 on its cores
    assert cluster.env(np=1)["MPIDIST_MACHINE_RANKS"] == "1"
    cluster = SimCluster(2, 4)
    cluster.agent = "agent.sh"
    assert cluster.env()["NUMBA_NUM_THREADS"] == "1"


@pytest.mark.launcher
@pytest.mark.timeout(300)
def test_hierarchical_allreduce_and_parameter_server_across_nodes():
    _need_namespaces()
    n = 1 << 20                                   # float64: 8 MiB per allreduce
    with SimCluster(nodes=2, ranks_per_node=2, bandwidth="1gbit") as cluster:
        proc = cluster.run([sys.executable, os.path.join(HERE, "cluster_check.py"), str(n)],
                           timeout=240, thread_level="serialized", capture_output=True,
                           text=True, cwd=REPO)
        names = cluster.node_ns
        counters = cluster.nic_counters()       # read from outside, the whole job's bytes
        info = cluster.run([sys.executable, "-m", "mpidist", "info"], timeout=120,
                           capture_output=True, text=True, cwd=REPO)
    assert info.returncode == 0, info.stderr[-3000:]
    assert "4 ranks on 2 node(s) (detected), ranks per node [2, 2]" in info.stdout, info.stdout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-12000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-3000:] + proc.stderr[-12000:]
    got = json.loads(line[0][len("RESULT "):])
    # real nodes: detected by the shared-memory split, on distinct hosts
    assert (got["size"], got["num_nodes"], got["node_sizes"]) == (4, 2, [2, 2])
    assert got["simulated"] is False
    assert got["hosts"] == sorted(names)
    assert got["hierarchical_matches"] and got["ps_matches"]
    assert got["ps_servers"] == [1, 3]                  # one server per node
    # the inter-node phase moved 2 (N-1)/N x n bytes out of each node's NIC (n for N = 2)
    assert len(got["nic_tx_bytes"]) == 2
    for sent in got["nic_tx_bytes"]:
        assert 0.95 * got["allreduce_bytes"] <= sent <= 1.5 * got["allreduce_bytes"], got
    assert all(tx >= sent for (tx, _), sent in zip(counters, got["nic_tx_bytes"])), counters


@pytest.mark.launcher          # one cluster, from the plain session (not one per rank)
@pytest.mark.timeout(300)      # above the run's own 240 s
def test_torch_across_nodes_equals_one_process():
    """mpidist.torch on 2 nodes x 2 ranks (the node's window or the hierarchical allreduce
    inside, TCP between the nodes) against one process on the global batch."""
    pytest.importorskip("torch", reason="needs PyTorch (the torch extra)")
    _need_namespaces()
    with SimCluster(nodes=2, ranks_per_node=2, bandwidth="1gbit") as cluster:
        proc = cluster.run([sys.executable, os.path.join(HERE, "torch_check.py")], timeout=240,
                           capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-12000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-3000:] + proc.stderr[-12000:]
    got = json.loads(line[0][len("RESULT "):])
    assert (got["size"], got["num_nodes"]) == (4, 2), got
    assert got["auto"] <= 1e-5 and got["hierarchical"] <= 1e-5, got


def _namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_a_job_past_its_timeout_is_killed_and_everything_torn_down(tmp_path):
    _need_namespaces()
    pidfile = tmp_path / "pid"
    cluster = SimCluster(nodes=2, ranks_per_node=1, bandwidth="100mbit")
    with pytest.raises(subprocess.TimeoutExpired):
        with cluster:
            made = list(cluster.node_ns) + [cluster.hub]
            assert set(made) <= set(_namespaces())
            cluster.run(["sh", "-c", f'echo $$ >> {pidfile}; exec sleep 600'], timeout=8)
    assert not set(made) & set(_namespaces())
    pids = pidfile.read_text().split()
    assert len(pids) == 2                      # one rank per node had started
    deadline = time.monotonic() + 10           # SIGKILLed: gone once their parents reap them
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), pids


def _alive(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_benchmark_rerun_on_the_cluster_drops_only_the_cluster_options():
    from mpidist.bench._driver import without_cluster_options
    argv = ["--sizes", "4M", "--cluster", "2x1", "--bandwidth=10gbit", "--reps", "3",
            "--cluster=2x2", "--bandwidth", "1gbit", "--out", "x"]
    assert without_cluster_options(argv) == ["--sizes", "4M", "--reps", "3", "--out", "x"]


@pytest.mark.launcher          # it starts its own cluster, from the plain session
@pytest.mark.timeout(300)
def test_bench_allreduce_runs_itself_on_the_cluster(tmp_path):
    from mpidist.launcher import without_job_variables   # as from a shell: not this session's job
    _need_namespaces()
    proc = subprocess.run([sys.executable, "-m", "mpidist", "bench", "allreduce", "--cluster",
                           "2x1", "--bandwidth", "1gbit", "--sizes", "64K",
                           "--algorithms", "native,ring", "--reps", "3", "--seconds", "0.2",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                          timeout=240, env=without_job_variables(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-12000:]
    assert "2 ranks on 2 node(s) (detected)" in proc.stdout, proc.stdout
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.strip().startswith("64K")]
    assert [r[1] for r in rows] == ["native", "ring"] and all(r[-1] == "ok" for r in rows), rows
    assert (tmp_path / "allreduce.json").exists()
