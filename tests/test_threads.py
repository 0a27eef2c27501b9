"""Threads per rank and whether a rank has a core of its own: from the affinity sets of the
host's ranks, so that unbound ranks share the host's cores and ranks a launcher bound to
cores of their own keep them (mpidist.threads)."""
import json
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import threads
from mpidist.launcher import mpi_vendor
from tests.plain import plain_mpiexec


def test_sharers_counts_the_ranks_that_may_run_on_my_cores():
    every = [frozenset({0, 1, 2, 3})] * 4                       # unbound: all share all
    assert threads.sharers(every[0], every) == 4
    bound = [frozenset({i}) for i in range(4)]                  # --bind-to core
    assert all(threads.sharers(s, bound) == 1 for s in bound)
    blocks = [frozenset({0, 1}), frozenset({2, 3})]             # srun --cpus-per-task=2
    assert threads.sharers(blocks[0], blocks) == 1
    assert threads.default_threads(len(blocks[0]), threads.sharers(blocks[0], blocks)) == 2
    sockets = [frozenset(range(8))] * 4 + [frozenset(range(8, 16))] * 4   # --bind-to socket
    assert all(threads.sharers(s, sockets) == 4 for s in sockets)
    assert threads.default_threads(8, 4) == 2                   # the 16 cores, one thread each
    pair = [frozenset({0}), frozenset({0}), frozenset({1, 2})]  # two ranks on one core
    assert threads.sharers(pair[0], pair) == 2 and threads.sharers(pair[2], pair) == 1
    assert threads.default_threads(2, 4) == 1 and threads.default_threads(16, 4) == 4


def test_threads_default_to_my_cores_over_the_ranks_that_share_them(comm):
    """Without NUMBA_NUM_THREADS, Numba's threads are this rank's cores over the host's ranks
    that may run on them (decided at the first world-sized communicator, here `comm` if no
    test made one before); the setting says where the number came from."""
    setting = threads.setting()
    assert setting is not None
    world = MPI.COMM_WORLD.Dup()
    host = world.Split_type(MPI.COMM_TYPE_SHARED)
    ranks = threads.sharers(threads.affinity(), host.allgather(threads.affinity()))
    ranks = max(ranks, int(os.environ.get(threads.ENV_MACHINE_RANKS) or 0))
    host.Free()
    world.Free()
    assert threads.core_per_rank() == (ranks <= threads.cores())
    import numba
    if os.environ.get("NUMBA_NUM_THREADS"):
        assert setting.numba_source == "NUMBA_NUM_THREADS"
        return
    want = threads.default_threads(threads.cores(), ranks)
    assert numba.get_num_threads() == min(want, numba.config.NUMBA_NUM_THREADS)
    assert f"/ {ranks} rank(s) sharing them" in setting.numba_source
    assert np.isfinite(setting.numba)


_REPORT = """
import json, os
from mpidist import threads
from mpidist.comm import Communicator
c = Communicator()
mine = [c.rank, sorted(os.sched_getaffinity(0)), threads.core_per_rank(),
        threads.setting().numba_source]
every = c.comm.gather(mine)
if c.rank == 0:                 # one line from one rank: the ranks' outputs may interleave
    print("REPORT " + json.dumps(every), flush=True)
"""


def _reports(binding, tmp_path, n=2, env=()):
    flag = "--bind-to" if mpi_vendor() == "openmpi" else "-bind-to"
    rc, out = plain_mpiexec(n, ["env", *env, sys.executable, "-c", _REPORT], tmp_path,
                            timeout=120, flags=[flag, binding])
    assert rc == 0, out
    return json.loads(next(line for line in out.splitlines() if line.startswith("REPORT "))[7:])


@pytest.mark.launcher
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding two ranks to cores of "
                    "their own needs two cores")
def test_plain_mpiexec_bound_or_not(tmp_path):
    """Two ranks each bound to a core of its own have one (one Numba thread, waits that may
    poll); unbound, they share the host's cores, and have one each where there are enough."""
    bound = _reports("core", tmp_path)
    assert len(bound) == 2 and set(bound[0][1]).isdisjoint(bound[1][1]), bound
    for _, cores, own, why in bound:
        assert own and why == f"{len(cores)} core(s) / 1 rank(s) sharing them", bound
    free = _reports("none", tmp_path)
    for _, cores, own, why in free:
        assert why == f"{len(cores)} core(s) / 2 rank(s) sharing them", free
        assert own == (len(cores) >= 2), free


@pytest.mark.launcher
def test_ranks_that_mpi_sees_on_other_hosts_of_this_machine_count(tmp_path):
    """MPIDIST_MACHINE_RANKS (the simulated cluster's nodes share one machine): a rank MPI
    sees alone on its host still counts that many ranks on its cores."""
    alone = _reports("none", tmp_path, n=1)
    c = len(alone[0][1])
    assert alone[0][2] and alone[0][3] == f"{c} core(s) / 1 rank(s) sharing them", alone
    crowded = _reports("none", tmp_path, n=1, env=[f"MPIDIST_MACHINE_RANKS={c + 1}"])
    assert not crowded[0][2], crowded
    assert crowded[0][3] == f"{c} core(s) / {c + 1} rank(s) sharing them", crowded
