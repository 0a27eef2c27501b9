"""Parallel-HDF5 checkpoints: one file per checkpoint, one dataset per global tensor, written
collectively by every rank, verified by CRC-32 on load and readable at any world size.

    from mpidist.checkpoint import CheckpointManager
    mgr = CheckpointManager("ckpt/", keep=3)            # collective
    mgr.save(step, state.tensors, scalars=state.scalars, meta={"config": cfg})
    with mgr.open_latest() as src:                      # newest good file, or None
        strategy.load_state_dict(src)
"""
from mpidist.checkpoint.format import (CheckpointError, CorruptCheckpointError,
                                       IncompatibleCheckpointError)
from mpidist.checkpoint.manager import CheckpointManager
from mpidist.checkpoint.reader import CheckpointReader, inspect_checkpoint, open_checkpoint
from mpidist.checkpoint.signals import REQUEUE_EXIT_CODE, Preemption
from mpidist.checkpoint.writer import write_checkpoint

__all__ = ["CheckpointManager", "Preemption", "REQUEUE_EXIT_CODE", "write_checkpoint",
           "open_checkpoint", "inspect_checkpoint", "CheckpointReader", "CheckpointError",
           "CorruptCheckpointError", "IncompatibleCheckpointError"]
