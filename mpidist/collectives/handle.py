"""One handle type for every operation that completes later: a reduction queued on a
worker thread (fusion, the shared-memory window), a nonblocking MPI exchange (ZeRO's
v-collectives), or a result already computed (the compressed allreduce).

wait() blocks until the operation is complete and returns its result (the workers' waits
stop napping meanwhile: collectives.waits.hurry), test() says without blocking whether it
is, and `done` becomes true once wait() has returned. A caller that starts several
operations can then treat them alike, whatever runs them.
"""
from __future__ import annotations

import time
from concurrent.futures import Future

from mpi4py import MPI

from mpidist.collectives import flight, waits

__all__ = ["Handle"]


class Handle:
    """A pending operation; wait() completes it (once) and returns its result.

    result: the result, or what `finish` turns into it.
    futures: worker-thread jobs (concurrent.futures); wait() re-raises their exceptions.
    requests: nonblocking MPI requests.
    finish: called once, after the futures and requests completed; returns the result.
    buffers: the arrays the operation holds while in flight (`nbytes` counts them).
    entry: the call's flight record, ended when the last future completes and at wait().
    """

    def __init__(self, result=None, *, futures: list[Future] = (), requests=(),
                 finish=None, buffers=(), entry=None):
        self._futures = list(futures)
        self._requests = list(requests)
        self._finish = finish
        self._result = result
        self._entry = entry
        self.buffers = tuple(buffers)
        self.done = False
        if entry is not None:
            pending = [len(self._futures)]

            def finished(_):
                pending[0] -= 1                 # done callbacks run one at a time: one worker
                if pending[0] == 0:
                    flight.end(entry)
            if not self._futures and not self._requests:
                flight.end(entry)
            for f in self._futures:
                f.add_done_callback(finished)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers this operation holds while in flight (0 once done)."""
        return 0 if self.done else sum(int(b.nbytes) for b in self.buffers)

    def test(self) -> bool:
        """Whether wait() would return without blocking (progresses MPI requests)."""
        if self.done:
            return True
        if not all(f.done() for f in self._futures):
            return False
        return not self._requests or MPI.Request.Testall(self._requests)

    def wait(self, timeout: float | None = None):
        """Block until complete (at most `timeout` seconds: TimeoutError) and return the
        result; later calls return the same result at once."""
        if self.done:
            return self._result
        deadline = None if timeout is None else time.monotonic() + timeout
        with waits.hurry():                     # the workers need not nap while this blocks
            for f in self._futures:
                f.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._requests:
            if deadline is None:
                MPI.Request.Waitall(self._requests)
            else:
                while not MPI.Request.Testall(self._requests):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"operation not complete after {timeout} s")
                    time.sleep(1e-4)
        if self._finish is not None:
            self._result = self._finish()
        self._finish, self._futures, self._requests = None, [], []
        self.done = True
        flight.end(self._entry)        # (the futures' callbacks may not have run yet)
        return self._result

    def then(self, fn) -> "Handle":
        """This handle, its result passed through fn when it completes (returns self)."""
        if self.done:
            self._result = fn(self._result)
            return self
        first, result = self._finish, self._result
        self._finish = (lambda: fn(first())) if first is not None else (lambda: fn(result))
        return self
