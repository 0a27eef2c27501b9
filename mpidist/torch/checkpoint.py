"""Checkpoints of torch models trained with mpidist.torch, in mpidist's parallel-HDF5 format
(one dataset per global tensor, CRC-32, atomic rename: mpidist.checkpoint).

Keys: `param/<name>` (trainable parameters), `frozen/<name>`, `buffer/<name>` (with a
model), `optim/<state>/<name>` (the mpidist optimizer's state of each parameter: moments,
float32 masters of half precision parameters). Under ZeRO each rank writes the pieces of
its shard; on load each rank reads the pieces of its own shard, so a checkpoint resumes at
any rank count and across data parallel and ZeRO stages 1 and 2. The optimizer's step count
is a scalar, with the optimizer's small extra state (1-bit LAMB's per-tensor ratios). A
1-bit optimizer's momentum exchange adds its error feedback residuals and counters
(mpidist.strategy.onebit's keys). A wrapped torch optimizer is not covered: save its
state_dict with torch.save.
"""
from __future__ import annotations

import numpy as np
import torch

from mpidist.checkpoint import CheckpointManager, open_checkpoint, write_checkpoint
from mpidist.checkpoint.format import IncompatibleCheckpointError
from mpidist.state import TensorPiece
from mpidist.torch.onebit import Onebit
from mpidist.torch.optimizer import DistributedOptimizer
from mpidist.kernels.backend import get_array_module
from mpidist.kernels.backend import to_numpy as host_array
from mpidist.torch.tensors import to_numpy

__all__ = ["save_checkpoint", "load_checkpoint", "state_tensors"]


def _check(opt) -> None:
    if not isinstance(opt, DistributedOptimizer):
        raise TypeError(f"expected a mpidist.torch.DistributedOptimizer, got "
                        f"{type(opt).__name__}")
    if isinstance(opt.optimizer, torch.optim.Optimizer):
        raise TypeError("checkpoints cover mpidist optimizers; for a wrapped torch optimizer "
                        "save its state_dict() with torch.save (rank 0)")


def state_tensors(opt: DistributedOptimizer, model=None) -> dict:
    """key -> this rank's part: whole arrays for replicated tensors, TensorPieces of the
    optimizer state of this rank's shard."""
    _check(opt)
    params = host_array(opt.flat_params)      # a CUDA model's: a host copy
    tensors = {f"param/{s.name}": params[s.offset:s.stop].reshape(s.shape) for s in opt.layout}
    if model is not None:
        frozen = {id(p) for p in opt.frozen}
        for name, p in model.named_parameters():
            if id(p) in frozen:
                tensors[f"frozen/{name}"] = np.ascontiguousarray(to_numpy(p.cpu()))
        for name, b in model.named_buffers():
            tensors[f"buffer/{name}"] = np.ascontiguousarray(to_numpy(b.cpu()))
    a, b = opt.shard
    for state, buf in opt.optimizer.state_buffers().items():
        buf = host_array(buf)
        for index, start, stop in opt.layout.clip(a, b):
            seg = opt.layout.segments[index]
            tensors[f"optim/{state}/{seg.name}"] = TensorPiece(
                seg.shape, start - seg.offset, buf[start - a:stop - a])
    if isinstance(opt.exchange, Onebit):
        tensors.update(opt.exchange.driver.pieces(opt.comm.rank, opt.comm.size))
    return tensors


def save_checkpoint(target, opt: DistributedOptimizer, step: int, *, model=None,
                    epoch: int | None = None, meta: dict | None = None) -> str:
    """Collective: write the model's and optimizer's state; target: a CheckpointManager
    (keeps the newest files) or a file path. Returns the path written."""
    tensors = state_tensors(opt, model)
    scalars = {"optim_step": int(opt.optimizer.step_count),
               "optim_extra": opt.optimizer.extra_state()}
    if isinstance(opt.exchange, Onebit):
        scalars.update(opt.exchange.driver.scalars())
    meta = {"optimizer": opt.optimizer.name, "hyper": opt.optimizer.hyper(),
            "zero": opt.zero, "ranks": opt.comm.size, **(meta or {})}
    if isinstance(target, CheckpointManager):
        return target.save(step, tensors, epoch=epoch, scalars=scalars, meta=meta)
    return write_checkpoint(str(target), tensors, step=step, epoch=epoch, scalars=scalars,
                            meta=meta, comm=opt.comm)


def load_checkpoint(source, opt: DistributedOptimizer, *, model=None) -> int:
    """Collective: restore what save_checkpoint wrote (source: an open CheckpointReader or
    a path), at any rank count and ZeRO stage; returns the checkpoint's step."""
    _check(opt)
    reader = open_checkpoint(str(source), comm=opt.comm) if isinstance(source, str) else source
    try:
        error = None
        try:
            want = {f"param/{s.name}": s.shape for s in opt.layout}
            reader.require(want)
            states = opt.optimizer.state_buffers()
            missing = [f"optim/{k}/{s.name}" for k in states for s in opt.layout
                       if f"optim/{k}/{s.name}" not in reader]
            if missing:
                raise IncompatibleCheckpointError(
                    f"the checkpoint has no optimizer state {missing[:3]}...: it was written "
                    f"by another optimizer ({reader.meta.get('optimizer')}) or precision")
        except (ValueError, IncompatibleCheckpointError) as exc:
            error = exc
        opt.comm.raise_if_any(error)
        xp = get_array_module(opt.flat_params)      # CuPy for a CUDA model
        for s in opt.layout:
            opt.flat_params[s.offset:s.stop] = xp.asarray(reader.read(f"param/{s.name}"))
        a, b = opt.shard
        sd = opt.optimizer.state_dict()
        for state, buf in sd["state"].items():
            for index, start, stop in opt.layout.clip(a, b):
                seg = opt.layout.segments[index]
                buf[start - a:stop - a] = get_array_module(buf).asarray(reader.read(
                    f"optim/{state}/{seg.name}", start - seg.offset, stop - start))
        sd["step"] = int(reader.scalars["optim_step"])
        if "optim_extra" in reader.scalars:
            sd["extra"] = reader.scalars["optim_extra"]
        opt.optimizer.load_state_dict(sd)
        if isinstance(opt.exchange, Onebit):
            opt.exchange.driver.restore(reader, [(0, opt.layout.numel)], opt.comm.rank,
                                        opt.comm.size)
        if model is not None:
            frozen = {id(p) for p in opt.frozen}
            for name, p in model.named_parameters():
                if id(p) in frozen and f"frozen/{name}" in reader:
                    p.data.copy_(torch.from_numpy(reader.read_full(f"frozen/{name}")))
            for name, t in model.named_buffers():
                if f"buffer/{name}" in reader:
                    t.data.copy_(torch.from_numpy(reader.read_full(f"buffer/{name}")))
        return int(reader.step)
    finally:
        if isinstance(source, str):
            reader.close()
