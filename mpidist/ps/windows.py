"""The parameter server's two MPI windows and their layout, shared by servers and workers.

Both windows are created with `MPI.Win.Allocate` over the whole parameter-server
communicator; only server ranks expose memory in the data window. Every rank opens one
passive-target epoch (`Lock_all`) for the life of the windows and completes its operations
with `Flush`, so a worker moves data without any cooperation from the server's code. The
words of the control window are listed in CtrlLayout's docstring.
See docs/ARCHITECTURE.md (ps).
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

__all__ = ["CtrlLayout", "Windows", "ABORT", "TICKET", "VERSION", "WRITING", "DONE", "PAUSE", "HALT",
           "pack_ticket", "unpack_ticket", "MPI_DTYPES"]

ABORT, TICKET, VERSION, WRITING = 0, 1, 2, 3
DONE = (4, 5)
PAUSE, HALT = 6, 7
_HEADER = 8
_EPOCH_SHIFT = 32
_ENTRY_MASK = (1 << _EPOCH_SHIFT) - 1

MPI_DTYPES = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}


def pack_ticket(epoch: int, entries: int) -> int:
    """The TICKET word: epoch << 32 | entries."""
    return (int(epoch) << _EPOCH_SHIFT) | int(entries)


def unpack_ticket(word: int) -> tuple[int, int]:
    """-> (epoch, entries)."""
    word = int(word)
    return word >> _EPOCH_SHIFT, word & _ENTRY_MASK


class CtrlLayout:
    """Offsets of the per-worker arrays in a server's control window, for W workers.

    Per server, the int64 control window holds (indices below):
        ABORT            rank + 1 of a rank that failed (every rank has this word)
        TICKET           epoch << 32 | entries: pushes that took a ticket in the open epoch
        VERSION          updates published (parameter buffer VERSION & 1 is current)
        WRITING          the version being written now (a reader of version v retries if > v + 1)
        DONE0, DONE1     pushes completed into accumulation slot 0 / 1
        PAUSE            (first server) 1 once any rank asked every worker to pause
        HALT             (first server, BSP) the clock at which every worker pauses (0: none)
        CNT0[W], CNT1[W] pushes per worker in slot 0 / 1
        APPLIED[W]       pushes per worker applied to the parameters (the SSP clocks)
        FIN[W]           1 + the worker's step count once it has finished (0 while running)
        PAUSED[W]        1 + the worker's step count while it pauses at a checkpoint (0 running)
    and the data window (the parameter dtype) holds, over the server's chunk() shard of c
    elements: PARAM0, PARAM1 (double-buffered parameters) and ACC0, ACC1 (double-buffered
    gradient accumulation slots), c elements each.
    """

    def __init__(self, workers: int):
        self.workers = W = int(workers)
        self.cnt = (_HEADER, _HEADER + W)
        self.applied = _HEADER + 2 * W
        self.fin = _HEADER + 3 * W
        self.paused = _HEADER + 4 * W
        self.server_words = _HEADER + 5 * W

    @staticmethod
    def data_offsets(count: int) -> dict:
        """Element offsets of PARAM0/1 and ACC0/1 in a data window with a shard of `count`."""
        return {"param": (0, count), "acc": (2 * count, 3 * count), "words": 4 * count}


class Windows:
    """The control and data windows of one parameter-server run (collective to create).

    Freed exactly once: `free()` is idempotent, and the owner calls it from `finally`.
    """

    def __init__(self, comm: MPI.Comm, *, is_server: bool, workers: int, count: int,
                 dtype: np.dtype):
        self.ctrl_layout = CtrlLayout(workers)
        self.dtype = np.dtype(dtype)
        self.mpi_dtype = MPI_DTYPES[self.dtype]
        self.count = int(count) if is_server else 0
        ctrl_words = self.ctrl_layout.server_words if is_server else _HEADER
        data_words = CtrlLayout.data_offsets(self.count)["words"] if is_server else 0
        self.ctrl = self.data = None
        self._locked = False
        try:
            self.ctrl = MPI.Win.Allocate(ctrl_words * 8, 8, comm=comm)
            self.data = MPI.Win.Allocate(data_words * self.dtype.itemsize, self.dtype.itemsize,
                                         comm=comm)
            self._zero_own_memory(ctrl_words, data_words)
            comm.Barrier()   # nobody touches a window before every rank has zeroed its own
            self.ctrl.Lock_all(MPI.MODE_NOCHECK)
            self.data.Lock_all(MPI.MODE_NOCHECK)
            self._locked = True
        except BaseException:
            self.free()
            raise
        self.rank = comm.Get_rank()
        self._res = np.zeros(1, np.int64)

    def _zero_own_memory(self, ctrl_words: int, data_words: int) -> None:
        """Win.Allocate gives uninitialised memory: zero it before anyone looks."""
        for win, nbytes in ((self.ctrl, ctrl_words * 8), (self.data, data_words * self.dtype.itemsize)):
            if nbytes:
                win.Lock(self._own_rank(win), MPI.LOCK_EXCLUSIVE)
                np.frombuffer(win.tomemory(), dtype=np.uint8, count=nbytes)[:] = 0
                win.Unlock(self._own_rank(win))

    @staticmethod
    def _own_rank(win: MPI.Win) -> int:
        return win.Get_group().Get_rank()

    # ------------------------------------------------------------------ atomics (ctrl)
    def fetch_op(self, target: int, index: int, value: int, op: MPI.Op,
                 result: np.ndarray | None = None, flush: bool = True) -> int | None:
        """Atomic fetch-and-op on one int64 word; with flush=False the caller flushes."""
        res = self._res if result is None else result
        origin = np.array([value], np.int64)
        self.ctrl.Fetch_and_op(origin, res, target, index, op)
        if not flush:
            return None
        self.ctrl.Flush(target)
        return int(res[0])

    def read(self, target: int, index: int) -> int:
        """The control word `index` of rank `target`, read atomically."""
        return self.fetch_op(target, index, 0, MPI.NO_OP)

    def swap(self, target: int, index: int, new: int) -> int:
        """Atomic swap (Fetch_and_op REPLACE); returns the old value. Not Compare_and_swap:
        Open MPI 4.x's osc/rdma, the default one-sided component where single-copy (CMA) is
        permitted, crashes in a 64-bit MPI_Compare_and_swap."""
        return self.fetch_op(target, index, new, MPI.REPLACE)

    def read_words(self, target: int, index: int, n: int, out: np.ndarray | None = None,
                   flush: bool = True) -> np.ndarray:
        """Atomic (per element) read of n int64 words with Get_accumulate(NO_OP)."""
        out = np.zeros(n, np.int64) if out is None else out
        self.ctrl.Get_accumulate([out, MPI.INT64_T], [out, MPI.INT64_T], target, (index, n, MPI.INT64_T), MPI.NO_OP)
        if flush:
            self.ctrl.Flush(target)
        return out

    def add_words(self, target: int, index: int, values: np.ndarray, flush: bool = True) -> None:
        """Atomic (per element) add of int64 words with Accumulate(SUM)."""
        values = np.ascontiguousarray(values, np.int64)
        self.ctrl.Accumulate([values, MPI.INT64_T], target, (index, values.size, MPI.INT64_T), MPI.SUM)
        if flush:
            self.ctrl.Flush(target)

    def replace_words(self, target: int, index: int, values: np.ndarray, flush: bool = True) -> None:
        """Atomic (per element) store of int64 words with Accumulate(REPLACE)."""
        values = np.ascontiguousarray(values, np.int64)
        self.ctrl.Accumulate([values, MPI.INT64_T], target, (index, values.size, MPI.INT64_T), MPI.REPLACE)
        if flush:
            self.ctrl.Flush(target)

    # ------------------------------------------------------------------ abort
    def aborted_by(self) -> int | None:
        """The rank that aborted the run, if any (read atomically from my own window)."""
        word = self.read(self.rank, ABORT)
        return word - 1 if word else None

    def abort(self, ranks) -> None:
        """Tell every rank in `ranks` that this rank failed (best effort, never raises)."""
        if not self._locked:
            return
        mark = np.array([self.rank + 1], np.int64)
        try:
            for r in ranks:
                self.ctrl.Accumulate([mark, MPI.INT64_T], r, (ABORT, 1, MPI.INT64_T), MPI.MAX)
            self.ctrl.Flush_all()
        except MPI.Exception:
            pass

    # ------------------------------------------------------------------ lifecycle
    @property
    def freed(self) -> bool:
        return self.ctrl is None and self.data is None

    def free(self) -> None:
        """Close the epochs and free both windows (collective; idempotent)."""
        locked, self._locked = self._locked, False
        for name in ("data", "ctrl"):
            win = getattr(self, name)
            if win is None:
                continue
            setattr(self, name, None)
            try:
                if locked:
                    win.Unlock_all()
            finally:
                win.Free()
