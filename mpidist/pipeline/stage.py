"""A model as a list of pipeline layers, and the Stage that runs a contiguous run of them.

`pipeline_layers(model)` gives (prefix, module) pairs whose parameters keep the model's
own names (prefix + name), so a stage's flat buffer holds the same tensors, under the same
names, as the single-rank model: checkpoints and comparisons line up.

mpidist.nn layers keep their forward caches on themselves (Linear._x, ...), one micro-batch
at a time. A Stage lets several micro-batches be in flight: `stash()` takes the caches the
last forward left (and the dropout generators' states before it), `unstash()` puts them
back before that micro-batch's backward.
See docs/ARCHITECTURE.md (pipeline).
"""
from __future__ import annotations

import copy
from typing import Sequence

import numpy as np

from mpidist.flat import FlatBuffer, Layout
from mpidist.kernels.backend import get_array_module
from mpidist.nn.models import CNN, GPT
from mpidist.nn.module import Module, Sequential, materialize

__all__ = ["pipeline_layers", "Stage", "stash_nbytes", "local_stages", "materialize_stages"]


class _GPTEmbedding(Module):
    """The GPT's token + position embeddings as one layer (its first pipeline layer)."""

    def __init__(self, tok: Module, pos: Module):
        super().__init__()
        self.tok = self.add_child("tok", tok)
        self.pos = self.add_child("pos", pos)

    def forward(self, ids, train=True):
        if ids.ndim != 2:
            raise ValueError(f"GPT takes ids of shape (batch, time), got {ids.shape}")
        xp = get_array_module(ids)
        return self.tok.forward(ids, train) + self.pos.forward(xp.arange(ids.shape[1]), train)

    def backward(self, dy):
        self.pos.backward(dy.sum(axis=0))
        self.tok.backward(dy)
        return None


class _ToImage(Module):
    """The CNN's first step: flat rows -> (N, C, H, W)."""

    def __init__(self, shape):
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x, train=True):
        self._in = x.shape
        return x.reshape(x.shape[0], *self.shape)

    def backward(self, dy):
        return dy.reshape(self._in)


def pipeline_layers(model: Module) -> list[tuple[str, Module]]:
    """The model as (prefix, layer) pairs in forward order.

    Supports Sequential models (MLP and any nn.Sequential), CNN and GPT.
    """
    if isinstance(model, GPT):
        return ([("", _GPTEmbedding(model.tok, model.pos))]
                + [(f"h{i}.", blk) for i, blk in enumerate(model.blocks)]
                + [("ln_f.", model.ln_f), ("head.", model.head)])
    if isinstance(model, CNN):
        return [("", _ToImage(model.in_shape))] + [
            (f"body.{name}.", layer) for name, layer in model.body.children()]
    if isinstance(model, Sequential):
        return [(f"{name}.", layer) for name, layer in model.children()]
    raise TypeError(f"cannot split {type(model).__name__} into pipeline stages: use an "
                    f"nn.Sequential (e.g. MLP), CNN or GPT")


def _modules(m: Module) -> list[Module]:
    out = [m]
    for _, child in m.children():
        out += _modules(child)
    return out


def _arrays(value, out: list) -> None:
    if hasattr(value, "nbytes") and hasattr(value, "shape"):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _arrays(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _arrays(v, out)


def _address(a) -> int:
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    return int(a.data.ptr)      # CuPy


def stash_nbytes(*values) -> int:
    """Bytes of memory the arrays in values (nested tuples, lists, dicts) span, each byte
    counted once however many views reach it."""
    arrays: list = []
    _arrays(values, arrays)
    spans = sorted((_address(a), _address(a) + int(a.nbytes)) for a in arrays if a.nbytes)
    total, end = 0, None
    for lo, hi in spans:
        if end is None or lo >= end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


_STRUCTURE = frozenset(("p", "g", "_params", "_children", "_hook", "_full_names"))


def _is_cache(name: str, value) -> bool:
    """Everything on a layer but its parameters, children and generators is per-forward
    state (restoring an unchanged setting along with it is harmless)."""
    return name not in _STRUCTURE and not isinstance(value, (Module, np.random.Generator))


class Stage:
    """The layers [lo, hi) of the pipeline layer list: one (virtual) stage."""

    def __init__(self, index: int, layers: Sequence[tuple[str, Module]]):
        if not layers:
            raise ValueError(f"stage {index} has no layers")
        self.index = int(index)
        self.layers = list(layers)
        self._modules = [m for _, layer in self.layers for m in _modules(layer)]
        self._rngs = [g for _, layer in self.layers for g in layer.generators()]

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [s for prefix, layer in self.layers for s in layer.param_shapes(prefix)]

    def bind(self, params: dict, grads: dict) -> None:
        for prefix, layer in self.layers:
            layer.bind(params, grads, prefix)

    def forward(self, x, train: bool = True):
        for _, layer in self.layers:
            x = layer.forward(x, train)
        return x

    def backward(self, dy):
        for _, layer in reversed(self.layers):
            dy = layer.backward(dy)
        return dy

    # -- several micro-batches in flight -------------------------------------------------
    def rng_state(self) -> list:
        """The dropout generators' states (taken before a forward, so a recomputation
        draws the same masks)."""
        return [g.bit_generator.state for g in self._rngs]

    def set_rng_state(self, state: list) -> None:
        """Restore the dropout generators' states (the forward re-run under recompute)."""
        for g, s in zip(self._rngs, state):
            g.bit_generator.state = s

    def stash(self) -> list[dict]:
        """The caches the last forward left on the layers."""
        return [{k: v for k, v in vars(m).items() if _is_cache(k, v)} for m in self._modules]

    def unstash(self, caches: list[dict]) -> None:
        """Put the layers' caches of one micro-batch back before its backward."""
        for m, cache in zip(self._modules, caches):
            vars(m).update(cache)


def local_stages(layers: Sequence[tuple[str, Module]], bounds: Sequence[int], pp: int,
                 rank: int) -> dict[int, Stage]:
    """{virtual stage: Stage} of pipeline rank `rank`: stages rank, rank + pp, ..."""
    if (len(bounds) - 1) % pp:
        raise ValueError(f"{len(bounds) - 1} stages do not split evenly over {pp} ranks")
    return {s: Stage(s, layers[bounds[s]:bounds[s + 1]])
            for s in range(rank, len(bounds) - 1, pp)}


def materialize_stages(model: Module, stages: dict[int, Stage], *, dtype=np.float32, xp=np,
                       seed: int = 0):
    """Flat parameter and gradient buffers for these stages, bound, holding exactly the
    values nn.materialize(model, seed=seed) gives the whole model.

    The whole model is initialised once on the host (a copy, then dropped), so a pipeline
    starts from the same weights as the single-rank run. Returns (layout, params, grads).
    """
    full = copy.deepcopy(model)
    full_layout, full_params, _ = materialize(full, dtype=dtype, xp=np, seed=seed)
    layout = Layout([s for k in sorted(stages) for s in stages[k].param_shapes()])
    params = FlatBuffer(layout, dtype=dtype, xp=xp)
    grads = FlatBuffer(layout, dtype=dtype, xp=xp)
    grads.data[...] = 0
    src = full_layout.views(full_params.data)
    for name, view in layout.views(params.data).items():
        view[...] = xp.asarray(src[name])
    for k in sorted(stages):
        stages[k].bind(layout.views(params.data), layout.views(grads.data))
    return layout, params, grads
