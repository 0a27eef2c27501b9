"""The one handle type: worker futures, MPI requests and finished results alike."""
import threading
from concurrent.futures import Future

import numpy as np
import pytest
from mpi4py import MPI

from mpidist.collectives import Handle


def test_a_finished_result_is_done_at_wait():
    h = Handle(5)
    assert h.test() and not h.done
    assert h.wait() == 5 and h.done and h.wait() == 5


def test_futures_finish_and_then_maps_the_result():
    fut, gate = Future(), threading.Event()
    h = Handle(futures=[fut], finish=lambda: fut.result() + 1).then(lambda v: v * 10)
    assert not h.test()
    with pytest.raises(TimeoutError):
        h.wait(timeout=0.01)
    threading.Thread(target=lambda: (gate.wait(), fut.set_result(2))).start()
    gate.set()
    assert h.wait() == 30 and h.done and h.test()


def test_a_worker_failure_is_raised_by_wait():
    fut = Future()
    fut.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        Handle(futures=[fut]).wait()


def test_requests_hold_their_buffers_until_waited(comm):
    mpi = comm.comm
    send = np.full(4, comm.rank, np.int64)
    recv = np.empty(4, np.int64)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    reqs = [mpi.Irecv(recv, left, 7), mpi.Isend(send, right, 7)]
    h = Handle(requests=reqs, finish=lambda: recv, buffers=(send, recv))
    assert h.nbytes == send.nbytes + recv.nbytes
    assert np.array_equal(h.wait(), np.full(4, left)) and h.nbytes == 0 and h.test()
    assert MPI.Request.Testall(reqs)
