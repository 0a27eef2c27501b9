"""torch's face of a DistributedOptimizer over an mpidist optimizer: `param_groups` as live
dicts whose values reach the fused kernels on the next step, and a `state_dict` that
torch.save / torch.load (weights_only) carry.

A script changes hyperparameters by writing into param_groups (a scheduler writes lr,
OneCycleLR momentum or betas); GroupSync reads the dicts before each update and hands
them to the optimizer (mpidist.optim.groups). The state dict holds each state buffer over
the whole model as one float32 tensor, gathered from the shards under ZeRO, so it loads
onto any rank count and ZeRO stage.
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from mpidist.partition import counts_displs
from mpidist.kernels.backend import to_numpy as host_array
from mpidist.torch.tensors import to_numpy

__all__ = ["delegated", "fused_defaults", "group_dicts", "GroupSync", "fused_state_dict",
           "load_fused_state"]


def delegated(name: str) -> property:
    """An attribute of torch.optim.Optimizer (param_groups, state, defaults) that lives in
    the wrapped torch optimizer once `_inner_torch` is set: its load_state_dict replaces
    param_groups with new dicts, which a scheduler on the wrapper must see."""
    def get(self):
        inner = self.__dict__.get("_inner_torch")
        return getattr(inner, name) if inner is not None else self.__dict__["_own_" + name]

    def put(self, value):
        inner = self.__dict__.get("_inner_torch")
        if inner is not None:
            setattr(inner, name, value)
        else:
            self.__dict__["_own_" + name] = value
    return property(get, put)


def fused_defaults(opt) -> dict:
    """The hyperparameters a param group of this mpidist optimizer holds (torch's names)."""
    if isinstance(opt.hyper()["lr"], str):         # the repr of a callable schedule
        raise TypeError("an lr schedule inside an mpidist optimizer would fight torch's "
                        "param_groups; give a number and a torch.optim.lr_scheduler on the "
                        "DistributedOptimizer")
    keys = ("lr", "weight_decay") + tuple(opt.group_hyper)
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in opt.hyper().items()
            if k in keys}


def group_dicts(params, groups) -> list[dict]:
    """torch-style group dicts over the trainable params: one group of all (groups None), or
    the given dicts ({"params": tensors, name: value}), which must hold every trainable
    parameter exactly once."""
    if groups is None:
        return [{"params": list(params)}]
    if isinstance(groups, dict) or not all(isinstance(g, dict) and "params" in g
                                           for g in groups):
        raise TypeError("param_groups must be a list of dicts, each with a 'params' list, as "
                        "torch.optim takes them")
    groups = [{**g, "params": list(g["params"])} for g in groups]
    mine, seen = {id(p) for p in params}, {}
    for k, g in enumerate(groups):
        for p in g["params"]:
            if id(p) not in mine:
                raise ValueError(f"param group {k} holds a tensor of shape {tuple(p.shape)} "
                                 f"that is not a trainable parameter of the model")
            if id(p) in seen:
                raise ValueError(f"a parameter is in param groups {seen[id(p)]} and {k}; "
                                 f"put each in one group")
            seen[id(p)] = k
    if len(seen) != len(mine):
        raise ValueError(f"{len(mine) - len(seen)} trainable parameter(s) are in no param "
                         f"group; put every trainable parameter in one (or freeze it)")
    return groups


class GroupSync:
    """Carries param_groups' values into the mpidist optimizer before each update.

    params: the trainable tensors in the layout's order (segment i is params[i])."""

    def __init__(self, params, optimizer):
        self.optimizer = optimizer
        self.index = {id(p): i for i, p in enumerate(params)}
        self.nseg = len(params)

    def apply(self, param_groups, unused) -> None:
        """param_groups: torch's dicts; unused: bool per segment, no gradient anywhere (not
        updated this step, as torch skips a parameter whose .grad is None)."""
        if len(param_groups) == 1 and not unused.any():
            self.optimizer.set_groups(None)
            self.optimizer.set_hyper(**{k: v for k, v in param_groups[0].items()
                                        if k != "params"})
            return
        groups = []
        for g in param_groups:
            mask = np.zeros(self.nseg, bool)
            mask[[self.index[id(p)] for p in g["params"]]] = True
            groups.append((mask & ~unused, {k: v for k, v in g.items() if k != "params"}))
        self.optimizer.set_groups(groups)


def _whole(buf, comm, shard, n) -> np.ndarray:
    """Collective when sharded: the state buffer over all n elements."""
    a, b = shard
    buf = host_array(buf)                  # a CUDA model's state: a host copy
    if b - a == n:
        return np.array(buf, np.float32)
    out = np.empty(n, np.float32)
    counts, displs = counts_displs(n, comm.size)
    comm.comm.Allgatherv(np.ascontiguousarray(buf, np.float32),
                         [out, counts, displs, MPI.FLOAT])
    return out


def fused_state_dict(opt, param_groups, comm, shard) -> dict:
    """The state of mpidist optimizer opt as torch.save carries it (collective under ZeRO)."""
    sd = opt.state_dict()
    n = opt.layout.numel
    index = {}
    groups = []
    for g in param_groups:
        ids = [index.setdefault(id(p), len(index)) for p in g["params"]]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
    return {"state": {k: torch.from_numpy(_whole(v, comm, shard, n))
                      for k, v in sorted(sd["state"].items())},
            "param_groups": groups,
            "mpidist": {"optimizer": sd["name"], "step": int(sd["step"]),
                        "param_dtype": sd["param_dtype"], "extra": sd["extra"],
                        "numel": n}}


def load_fused_state(opt, param_groups, state: dict, shard) -> None:
    """Restore fused_state_dict's output into opt (this rank's shard) and param_groups."""
    if not isinstance(state, dict) or "mpidist" not in state:
        raise TypeError("load_state_dict expects a DistributedOptimizer.state_dict() of an "
                        "mpidist optimizer (keys 'state', 'param_groups', 'mpidist')")
    meta = state["mpidist"]
    if meta["numel"] != opt.layout.numel or len(state["param_groups"]) != len(param_groups):
        raise ValueError(f"the state dict is for {meta['numel']} elements in "
                         f"{len(state['param_groups'])} param group(s); this optimizer has "
                         f"{opt.layout.numel} in {len(param_groups)}")
    for saved, g in zip(state["param_groups"], param_groups):
        if len(saved["params"]) != len(g["params"]):
            raise ValueError("the state dict's param groups hold other parameters")
    a, b = shard
    opt.load_state_dict({"name": meta["optimizer"], "step": meta["step"],
                         "param_dtype": meta["param_dtype"], "extra": meta["extra"],
                         "state": {k: np.ascontiguousarray(to_numpy(v)[a:b])
                                   for k, v in state["state"].items()}})
    for saved, g in zip(state["param_groups"], param_groups):
        g.update({k: v for k, v in saved.items() if k != "params"})
