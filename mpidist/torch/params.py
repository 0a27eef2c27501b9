"""The parameters a DistributedOptimizer trains: how a model names them, the checks on
them and on the settings (local, then the same on every rank), and broadcasts of tensors
and of an optimizer's state from one rank."""
from __future__ import annotations

import numbers

import numpy as np
import torch

from mpidist.comm import as_communicator
from mpidist.errors import MismatchError
from mpidist.kernels.backend import cupy_available
from mpidist.kernels.backend import to_numpy as to_host
from mpidist.optim import Optimizer as FlatOptimizer
from mpidist.strategy.onebit import is_onebit
from mpidist.torch.tensors import to_numpy

__all__ = ["PARAM_DTYPES", "named_parameters", "check_params", "check_settings",
           "check_onebit", "check_same_params", "bcast_tensor", "broadcast_parameters",
           "bcast_state"]

PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def named_parameters(model) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a module, a dict, pairs, or bare tensors (named p0, p1, ...)."""
    if isinstance(model, torch.nn.Module):
        return list(model.named_parameters())       # a tied weight once
    if isinstance(model, dict):
        return list(model.items())
    if isinstance(model, torch.Tensor):
        raise TypeError("pass a torch.nn.Module, model.named_parameters() or a list of "
                        "parameters, not a single tensor")
    items = list(model)
    if all(isinstance(x, torch.Tensor) for x in items):
        return [(f"p{i}", x) for i, x in enumerate(items)]
    if all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor)
           for x in items):
        return [(str(n), x) for n, x in items]
    raise TypeError("parameters must be a torch.nn.Module, (name, tensor) pairs or tensors")


def _check_device(trainable) -> None:
    devices = sorted({str(p.device) for _, p in trainable})
    if len(devices) > 1:
        where = {d: next(n for n, p in trainable if str(p.device) == d) for d in devices}
        raise ValueError(f"the parameters live on several devices ({where}); a gradient "
                         f"bucket holds one device: move the model with model.to(device)")
    device = trainable[0][1].device
    if device.type == "cuda":
        if not cupy_available():
            raise ValueError("a model on CUDA needs CuPy (the flat buffers, the fused "
                             "update and MPI's view of them): pip install 'mpidist[gpu]'")
        if trainable[0][1].dtype == torch.bfloat16:
            raise TypeError("CuPy has no bfloat16: keep a CUDA model's parameters in "
                            "float32 or float16 (torch.autocast computes in bfloat16)")
    elif device.type != "cpu":
        raise ValueError(f"parameters on {device}: mpidist.torch.DistributedOptimizer "
                         f"trains CPU and CUDA tensors; move the model with "
                         f"model.to('cpu') or model.to('cuda')")


def check_settings(optimizer, op, k, bucket_mb, zero, compression, options, hyper,
                   groups, device) -> None:
    """The local checks of the settings (TypeError/ValueError saying what to do)."""
    if groups is not None and not isinstance(optimizer, str):
        raise TypeError("param_groups go with an optimizer name; a torch optimizer brings "
                        "its own groups (torch.optim.AdamW(groups, ...))")
    if op not in ("avg", "sum"):
        raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {k!r}")
    if not isinstance(bucket_mb, numbers.Real) or bucket_mb < 0:
        raise ValueError(f"bucket_mb must be a number >= 0, got {bucket_mb!r}")
    if zero == 3:
        raise ValueError("ZeRO stage 3 (parameters sharded and gathered around each "
                         "module's forward and backward) is not built for torch "
                         "modules; use zero=2 (sharded optimizer state, reduce-"
                         "scattered gradients)")
    if zero not in (0, 1, 2):
        raise ValueError(f"zero must be 0, 1 or 2, got {zero!r}")
    if zero and isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("ZeRO shards an mpidist optimizer's state: pass an optimizer "
                        "name (e.g. 'adamw') instead of a torch optimizer")
    if zero and compression not in (None, "none"):
        raise ValueError("compression with ZeRO is not supported here; use zero=0")
    if options and compression in (None, "none"):
        raise ValueError("compression_options need a compression name")
    if device.type == "cuda" and zero:
        raise ValueError("ZeRO for a model on CUDA is not built here; use zero=0 (the "
                         "flat buffers and the update on the device)")
    if hyper and not isinstance(optimizer, str):
        raise TypeError(f"hyperparameters {sorted(hyper)} go with an optimizer name "
                        f"(e.g. DistributedOptimizer(model, 'adamw', lr=1e-3))")


def check_onebit(opt, zero, compression, device) -> None:
    if not is_onebit(opt):
        return
    if device.type == "cuda":
        raise ValueError(f"optimizer {opt.name!r} trains CPU models here; on CUDA use "
                         f"'adamw', 'sgd', 'lamb' or 'lars' (compression= compresses)")
    if compression not in (None, "none"):
        raise ValueError(f"optimizer {opt.name!r} compresses its momentum itself (its "
                         f"compressor option); remove compression={compression!r}")
    if zero == 2:
        raise ValueError(f"optimizer {opt.name!r} runs data parallel (zero=0) or with ZeRO "
                         f"stage 1 (zero=1) here; stage 2 is not built for it")


def check_params(named, optimizer) -> None:
    """The local checks of the parameters (TypeError/ValueError saying what to do)."""
    if not named:
        raise ValueError("the model has no parameters")
    seen: dict = {}
    for name, p in named:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {name!r} is a {type(p).__name__}, not a torch tensor")
        if p.device.type == "meta":         # no storage to compare (the device check says no)
            continue
        if p.data_ptr() in seen and p.numel() > 0:
            raise ValueError(f"parameter {name!r} is the same tensor as {seen[p.data_ptr()]!r}; "
                             f"pass each parameter once (model.parameters() removes duplicates)")
        seen[p.data_ptr()] = name
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise ValueError("no parameter requires grad; unfreeze some (requires_grad=True)")
    _check_device(trainable)
    dtypes = sorted({str(p.dtype) for _, p in trainable})
    if len(dtypes) > 1:
        raise TypeError(f"the trainable parameters have several dtypes ({', '.join(dtypes)}); "
                        f"cast the model to one (model.to(torch.bfloat16)); mpidist "
                        f"optimizers keep float32 masters of half precision parameters")
    if trainable[0][1].dtype not in PARAM_DTYPES:
        raise TypeError(f"parameters must be float32, float16 or bfloat16, got "
                        f"{trainable[0][1].dtype}")
    if isinstance(optimizer, torch.optim.Optimizer):
        mine = {id(p) for _, p in trainable}
        frozen = {id(p) for _, p in named if not p.requires_grad}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in frozen:
                    raise ValueError("the torch optimizer holds a frozen parameter "
                                     "(requires_grad=False); build it over the trainable ones")
                if id(p) not in mine:
                    raise ValueError(f"the torch optimizer holds a tensor of shape "
                                     f"{tuple(p.shape)} that is not one of the model's "
                                     f"parameters; build it over model.parameters() of the "
                                     f"model passed here")


def check_same_params(c, named) -> None:
    """Collective: the same names, shapes, dtypes and order on every rank, else
    MismatchError everywhere naming the first difference."""
    mine = [(n, tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for n, p in named]
    every = c.comm.allgather(mine)
    for r, theirs in enumerate(every):
        if theirs == every[0]:
            continue
        k = next((i for i, (a, b) in enumerate(zip(theirs, every[0])) if a != b),
                 min(len(theirs), len(every[0])))
        a = every[0][k] if k < len(every[0]) else "nothing"
        b = theirs[k] if k < len(theirs) else "nothing"
        raise MismatchError(f"the model differs between ranks: parameter {k} is {a} on rank 0 "
                            f"and {b} on rank {r} ((name, shape, dtype, requires_grad)); build "
                            f"the same model on every rank, its parameters in the same order")


def bcast_tensor(c, t: torch.Tensor, root: int) -> None:
    """Collective: t (any layout) takes root's values in place. A CUDA tensor goes through
    a host copy: .cpu() waits for the work queued on torch's current stream, and the copy
    back is queued on it."""
    if t.device.type != "cpu":
        host = t.detach().cpu()
        bcast_tensor(c, host, root)
        t.copy_(host)
        return
    a = to_numpy(t)
    if not a.flags.c_contiguous:
        b = np.ascontiguousarray(a)
        c.comm.Bcast(b.view(np.uint8), root=root)
        a[...] = b
    else:
        c.comm.Bcast(a.reshape(-1).view(np.uint8), root=root)


def broadcast_parameters(params, root_rank: int = 0, comm=None) -> None:
    """Collective: overwrite every tensor with root_rank's (in place).

    params: a module (its parameters and buffers), a state_dict, named parameters or tensors.
    """
    c = as_communicator(comm)
    if isinstance(params, torch.nn.Module):
        named = list(params.state_dict(keep_vars=True).items())
    else:
        named = named_parameters(params)
    check_same_params(c, [(n, t) for n, t in named])
    for _, t in named:
        if t.numel():
            bcast_tensor(c, t.data, root_rank)


def bcast_state(c, optimizer, root: int) -> None:
    """Collective: optimizer (an mpidist flat optimizer or a torch optimizer) takes root's
    state; a flat optimizer's arrays go as they are, a torch optimizer's state_dict pickled."""
    if isinstance(optimizer, FlatOptimizer):
        sd = optimizer.state_dict()
        sd["state"] = {k: to_host(b) for k, b in sd["state"].items()}    # CuPy: a host copy
        for _, b in sorted(sd["state"].items()):
            c.comm.Bcast(b, root=root)
        sd["step"] = c.comm.bcast(sd["step"], root=root)
        optimizer.load_state_dict(sd)
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a DistributedOptimizer, an mpidist optimizer or a "
                        f"torch.optim.Optimizer, got {type(optimizer).__name__}")
    state = c.comm.bcast(optimizer.state_dict() if c.rank == root else None, root=root)
    if c.rank != root:
        optimizer.load_state_dict(state)
