"""How a patient thread waits for its MPI requests (collectives.waits): it naps between
tests beside compute, and, where each rank has a core of its own, stops napping while a
caller blocks in hurry() or while its own predicate holds. Real requests on a duplicate of
COMM_SELF, so every rank count runs it."""
import contextlib
import threading
import time
import types

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import backoff, threads
from mpidist.collectives import waits

pytestmark = pytest.mark.skipif(MPI.Query_thread() < MPI.THREAD_MULTIPLE,
                                reason="a patient thread and the sender call MPI at once: "
                                       "needs MPI_THREAD_MULTIPLE")


@pytest.fixture
def own_core(monkeypatch):
    monkeypatch.setattr(threads, "core_per_rank", lambda: True)


@pytest.fixture
def shared_cores(monkeypatch):
    monkeypatch.setattr(threads, "core_per_rank", lambda: False)


@pytest.fixture
def naps(monkeypatch):
    """The naps the patient thread takes (the sleeps still happen)."""
    taken = []

    def sleep(seconds):
        if threading.current_thread().name == "patient":
            taken.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(backoff, "time", types.SimpleNamespace(
        sleep=sleep, perf_counter=time.perf_counter))
    return taken


def _message_to_self_after(delay: float, hurry=None, hold: bool = False) -> float:
    """A patient thread waits for a message that this thread sends it after `delay`
    seconds (inside waits.hurry() when hold); returns the value received."""
    comm = MPI.COMM_SELF.Dup()
    got, posted = np.zeros(1), threading.Event()

    def patient():
        waits.mark_patient(hurry)
        request = comm.Irecv(got, 0, 7)
        posted.set()
        waits.waitall([request])

    thread = threading.Thread(target=patient, name="patient")
    try:
        with waits.hurry() if hold else contextlib.nullcontext():
            thread.start()
            posted.wait(10)
            time.sleep(delay)
            comm.Send(np.ones(1), 0, 7)
            thread.join(10)
    finally:
        comm.Free()
    assert not thread.is_alive()
    return float(got[0])


def test_a_patient_thread_naps_while_the_message_is_late(naps, own_core):
    assert _message_to_self_after(0.05) == 1.0
    assert len(naps) > 10 and max(naps) == pytest.approx(backoff.LONGEST_NAP)


def test_while_a_caller_blocks_in_hurry_it_does_not_nap(naps, own_core):
    assert _message_to_self_after(0.05, hold=True) == 1.0
    assert naps == []


def test_nor_while_its_own_predicate_holds(naps, own_core):
    assert _message_to_self_after(0.05, hurry=lambda: True) == 1.0
    assert naps == []


def test_with_ranks_sharing_cores_it_naps_even_when_hurried(naps, shared_cores):
    assert _message_to_self_after(0.05, hurry=lambda: True, hold=True) == 1.0
    assert len(naps) > 10


def test_hurry_ends_with_its_block(own_core):
    with waits.hurry():
        with waits.hurry():
            assert waits._pause().hurry()
        assert waits._pause().hurry()
    assert not waits._pause().hurry()
