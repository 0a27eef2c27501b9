"""Ending the threads mpidist starts: each one gone from the kernel before the caller goes on.

join() returns once a thread's Python state is deleted, but the thread is not over yet: the
C library then hands the unused part of its stack back to the kernel (madvise), while the
caller goes on to stop the next worker (whose exit unmaps memory) or to free a shared
window (munmap) or make one (mmap). On some Linux kernels (seen on 6.18) two such calls of
one process at the same moment can block each other for good: both threads asleep in the
kernel, nothing holding the address space's lock, the rank stuck in whatever it called
next while the other ranks wait for it. So a thread mpidist stops is waited for until its
/proc/self/task entry is gone, which takes microseconds, and so no two of them end at once.
"""
from __future__ import annotations

import os
import threading
import time

__all__ = ["join", "shutdown"]

GONE_WITHIN = 5.0       # seconds to wait for the kernel to let a joined thread go


def _gone(native_id: int | None) -> None:
    """Wait (at most GONE_WITHIN s) until thread native_id has left the kernel's task list.
    Where /proc is not there (not Linux), nothing to wait for."""
    if native_id is None or not os.path.isdir("/proc/self/task"):
        return
    path, deadline = f"/proc/self/task/{native_id}", time.monotonic() + GONE_WITHIN
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(50e-6)


def join(thread: threading.Thread) -> None:
    """thread.join(), then until the thread is gone from the kernel too."""
    thread.join()
    _gone(thread.native_id)


def shutdown(pool) -> None:
    """pool.shutdown(wait=True) of a concurrent.futures.ThreadPoolExecutor (its queued
    work done), then until each of its threads is gone from the kernel, one at a time."""
    threads = list(getattr(pool, "_threads", ()))
    pool.shutdown(wait=True)
    for t in threads:
        _gone(t.native_id)
