"""Threads mpidist stops are gone from the kernel, not only joined, when the stop returns."""
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mpidist import threadend

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")


def test_a_joined_thread_has_left_the_kernel():
    t = threading.Thread(target=lambda: None)
    t.start()
    threadend.join(t)
    assert not t.is_alive()
    assert not os.path.exists(f"/proc/self/task/{t.native_id}")


def test_a_pool_shut_down_has_done_its_work_and_its_threads_have_left_the_kernel():
    pool = ThreadPoolExecutor(max_workers=2)
    futures = [pool.submit(threading.get_native_id) for _ in range(8)]
    threadend.shutdown(pool)
    ids = {f.result() for f in futures}
    assert ids and all(not os.path.exists(f"/proc/self/task/{i}") for i in ids)
