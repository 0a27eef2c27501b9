"""The parameters a DistributedOptimizer trains: how a model names them, the checks on
them (local, then the same on every rank), and broadcasts of tensors from one rank."""
from __future__ import annotations

import numpy as np
import torch

from mpidist.comm import as_communicator
from mpidist.errors import MismatchError
from mpidist.torch.tensors import to_numpy

__all__ = ["PARAM_DTYPES", "named_parameters", "check_params", "check_same_params",
           "bcast_tensor", "broadcast_parameters"]

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
    if devices[0] != "cpu":
        # CUDA parameters would need the flat buffers on the device and each bucket ordered
        # after torch's current stream before MPI reads it; that path is not built here
        raise ValueError(f"parameters on {devices[0]}: mpidist.torch.DistributedOptimizer "
                         f"trains CPU tensors; run the model on the CPU, or train CUDA "
                         f"models with torch DDP over init_process_group('mpidist')")


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
