"""A directory of checkpoints: names by step, keeps the last K, loads the newest good one.

    ckpt/ckpt-00000100.h5, ckpt/ckpt-00000200.h5, ...

A checkpoint that fails to open or verify (truncated, flipped bytes) is reported and the
previous one is used; the damaged file is left in place for inspection and no longer counts
towards the K kept.
"""
from __future__ import annotations

import os
import re
import sys
import warnings

from mpidist.checkpoint import format as fmt
from mpidist.checkpoint.reader import CheckpointReader
from mpidist.checkpoint.writer import write_checkpoint
from mpidist.comm import as_communicator

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Collective over comm: save(step, tensors, ...), open_latest(), steps().

    directory: where checkpoints live (created by rank 0); keep: how many to keep (>= 1);
    prefix: file name prefix; collective: collective or independent MPI-IO writes (default:
    collective across nodes, independent within one; see write_checkpoint); fsync: make
    each file durable before it is renamed into place.
    """

    def __init__(self, directory: str, *, keep: int = 3, prefix: str = "ckpt", comm=None,
                 collective: bool | None = None, fsync: bool = True):
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path, got {type(directory).__name__}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
            raise ValueError(f"prefix must be letters, digits, '_', '.', '-', got {prefix!r}")
        self.comm = as_communicator(comm)
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep = keep
        self.prefix = prefix
        self.collective = collective
        self.fsync = fsync
        self._pattern = re.compile(rf"{re.escape(prefix)}-(\d+)\.h5")
        self.skipped: list[tuple[str, str]] = []    # (path, reason) of files found damaged

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"{self.prefix}-{int(step):08d}.h5")

    def steps(self) -> list[int]:
        """Collective: steps of the checkpoint files present, ascending (rank 0 lists)."""
        return self.comm.comm.bcast(self._local_steps() if self.comm.rank == 0 else None, root=0)

    def save(self, step: int, tensors, *, epoch: int | None = None, scalars: dict | None = None,
             meta: dict | None = None, rank_meta=None) -> str:
        """Collective: write checkpoint `step` atomically, then delete all but the newest K."""
        path = write_checkpoint(self.path(step), tensors, step=step, epoch=epoch, scalars=scalars,
                                meta=meta, rank_meta=rank_meta, comm=self.comm,
                                collective=self.collective, fsync=self.fsync)
        if self.comm.rank == 0:
            damaged = {p for p, _ in self.skipped}
            good = [s for s in self._local_steps() if self.path(s) not in damaged]
            for s in good[:-self.keep]:
                _remove(self.path(s))
        self.comm.comm.Barrier()
        return path

    def open_latest(self, *, verify: bool = True) -> CheckpointReader | None:
        """Collective: the newest checkpoint that opens and verifies, or None if there is none.

        Damaged files are reported (a warning on rank 0, and in self.skipped) and skipped.
        """
        for step in reversed(self.steps()):
            path = self.path(step)
            try:
                return CheckpointReader(path, comm=self.comm, verify=verify)
            except fmt.CorruptCheckpointError as exc:
                self.skipped.append((path, str(exc)))
                if self.comm.rank == 0:
                    warnings.warn(f"skipping damaged checkpoint: {exc}", RuntimeWarning, stacklevel=2)
                    print(f"[mpidist.checkpoint] skipping damaged checkpoint: {exc}",
                          file=sys.stderr, flush=True)
        return None

    def _local_steps(self) -> list[int]:
        return sorted(int(m.group(1)) for name in _listdir(self.directory)
                      if (m := self._pattern.fullmatch(name)))


def _listdir(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
