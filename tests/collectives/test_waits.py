"""How a thread waits for MPI requests: a wait told to nap leaves the core between tests."""
import time

import numpy as np
import pytest

from mpidist.collectives.waits import waitall

LATE = 0.3          # seconds the sending rank waits before it sends


@pytest.mark.mpi(min_size=2)
def test_a_napping_wait_leaves_the_core_while_it_waits(comm):
    # rank 0 waits for a message rank 1 sends late: with nap=True its thread spends a small
    # part of that wait on the CPU (MPI_Wait, which spins in Open MPI, would spend all of it)
    mpi, got = comm.comm, np.zeros(4)
    if comm.rank == 0:
        req = mpi.Irecv(got, 1, 77)
        mpi.Barrier()
        wall, cpu = time.perf_counter(), time.thread_time()
        waitall([req], nap=True)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    else:
        mpi.Barrier()
        if comm.rank == 1:
            time.sleep(LATE)
            mpi.Send(np.ones(4), 0, 77)
    mpi.Barrier()
    if comm.rank == 0:
        assert np.all(got == 1.0)
        assert wall >= 0.8 * LATE
        assert cpu < 0.3 * wall, f"{cpu:.3f} s of CPU in a {wall:.3f} s wait"
