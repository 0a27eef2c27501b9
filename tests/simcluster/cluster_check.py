"""Run on a simulated cluster (tests/simcluster): prints one JSON line from rank 0 with
what each check found. Hierarchical allreduce and the parameter server are compared with
MPI_Allreduce of the same data; the NIC counters show the bytes went over the links."""
import faulthandler
import json
import sys

import numpy as np
from mpi4py import MPI

from mpidist.collectives import allreduce
from mpidist.comm import Communicator
from mpidist.ps import ParameterServer
from mpidist.simcluster import nic_bytes


STACKS_AFTER = 200      # seconds; the test gives the run 240


def main() -> None:
    # a hang ends with every rank's stack on stderr, before the test's own timeout
    faulthandler.dump_traceback_later(STACKS_AFTER, exit=True)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    c = Communicator()
    out = {"size": c.size, "num_nodes": c.num_nodes, "node_sizes": c.node_sizes,
           "simulated": c.simulated_nodes, "hosts": sorted(set(c.comm.allgather(
               MPI.Get_processor_name())))}
    # 1. hierarchical allreduce against MPI_Allreduce (float64: ULP-close; int64: exact)
    rng = np.random.default_rng(c.rank)
    x = rng.standard_normal(n)
    ref = np.empty_like(x)
    c.comm.Allreduce(x, ref, MPI.SUM)
    before = nic_bytes()
    c.comm.Barrier()
    got = allreduce(x, algorithm="hierarchical", comm=c, out=np.empty_like(x))
    c.comm.Barrier()
    after = nic_bytes()
    k = np.arange(n, dtype=np.int64) * (c.rank + 1)
    kref = np.empty_like(k)
    c.comm.Allreduce(k, kref, MPI.SUM)
    exact = np.array_equal(allreduce(k, algorithm="hierarchical", comm=c, out=np.empty_like(k)), kref)
    ok = bool(np.allclose(got, ref, rtol=1e-12, atol=1e-12)) and exact
    out["hierarchical_matches"] = c.all(ok)
    # bytes the node's NIC sent during the float64 allreduce (local rank 0 reads it)
    sent = after[0] - before[0] if (before and after and c.local_rank == 0) else None
    out["nic_tx_bytes"] = [s for s in c.comm.allgather(sent) if s is not None]
    out["allreduce_bytes"] = x.nbytes
    # 2. parameter server (2 servers, BSP, plain sums): 3 steps against MPI_Allreduce
    steps = 3
    with ParameterServer(np.zeros(n // 4, np.float32), comm=c, servers=2, average=False,
                         timeout=120) as ps:
        mine = np.zeros(n // 4, np.float32)
        if ps.is_server:
            ps.serve()
        else:
            for t in range(steps):
                g = np.arange(n // 4, dtype=np.float32) % 97 + ps.worker_index + t
                ps.worker.pull()
                ps.worker.push(g)
                mine += g
            ps.worker.finish()
        params = ps.parameters()
        total = np.empty_like(mine)
        c.comm.Allreduce(mine, total, MPI.SUM)
        out["ps_servers"] = ps.server_ranks
        out["ps_matches"] = c.all(np.array_equal(params, total))
    if c.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    c.free()


if __name__ == "__main__":
    main()
