"""The layers ZeRO moves parameters and gradients for, and the hooks around their compute.

A *unit* is one module with parameters of its own (Linear, LayerNorm, Embedding, Conv2d...):
its own parameters are contiguous in the flat layout (a module lists its own parameters
before its children's), so a unit is one global range [lo, hi). Stages 2 and 3 rebind a
unit's gradient (and, at stage 3, parameter) views to short-lived buffers around its
forward and backward.

The hooks wrap the layers at the instance level (an instance attribute shadows the class's
forward/backward), so every container, however it calls its children, goes through them,
and the layer classes stay untouched; remove() restores the plain methods.
See docs/ARCHITECTURE.md (ZeRO).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mpidist.kernels.backend import get_array_module

__all__ = ["Unit", "find_units", "placeholder", "LayerHooks"]


def placeholder(xp, dtype, shape):
    """A read-only array of the right shape that holds no memory: a released parameter."""
    return xp.broadcast_to(xp.zeros((), dtype=dtype), shape)


@dataclass(eq=False)
class Unit:
    """One module's own parameters: full names, local names, shapes, global range [lo, hi)."""
    index: int
    module: object
    names: tuple[str, ...]       # full names, as in the layout
    local: tuple[str, ...]       # the module's own names (keys of module.p / module.g)
    shapes: tuple[tuple[int, ...], ...]
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def _views(self, flat):
        out, at = {}, 0
        for name, shape in zip(self.local, self.shapes):
            n = math.prod(shape)
            out[name] = flat[at:at + n].reshape(shape)
            at += n
        return out

    def bind_params(self, flat) -> None:
        """Point the module's parameters at flat (this unit's range) or release them (None)."""
        self._bind(self.module.p, flat)

    def bind_grads(self, flat) -> None:
        self._bind(self.module.g, flat)

    def _bind(self, table: dict, flat) -> None:
        if flat is None:
            old = next(iter(table.values()))
            xp = get_array_module(old)
            for name, shape in zip(self.local, self.shapes):
                table[name] = placeholder(xp, old.dtype, shape)
        else:
            table.update(self._views(flat))


def find_units(model, layout) -> list[Unit]:
    """Every module of the model that holds parameters of its own, in layout order."""
    units: list[Unit] = []

    def walk(module, prefix):
        own = list(getattr(module, "_params", []))
        if own:
            names = tuple(prefix + n for n, _ in own)
            segs = [layout[n] for n in names]
            for a, b in zip(segs, segs[1:]):
                if b.offset != a.stop:
                    raise ValueError(f"parameters of {type(module).__name__} ({', '.join(names)}) "
                                     f"are not contiguous in the layout; build the layout from "
                                     f"model.param_shapes()")
            units.append(Unit(len(units), module, names, tuple(n for n, _ in own),
                              tuple(s.shape for s in segs), segs[0].offset, segs[-1].stop))
        for cname, child in getattr(module, "_children", []):
            walk(child, prefix + cname + ".")

    walk(model, "")
    units.sort(key=lambda u: u.lo)
    for i, u in enumerate(units):
        u.index = i
    covered = sum(u.numel for u in units)
    if covered != layout.numel:
        raise ValueError(f"the model's layers own {covered} parameters but the layout has "
                         f"{layout.numel}; build the layout from model.param_shapes()")
    return units


class LayerHooks:
    """Calls before/after each unit's forward and backward (and reset, for initialisation).

    callbacks: any of pre_forward, post_forward, pre_backward, post_backward, pre_reset,
    post_reset, each f(unit).
    """

    METHODS = ("forward", "backward", "reset")

    def __init__(self, units, **callbacks):
        unknown = set(callbacks) - {f"{w}_{m}" for w in ("pre", "post") for m in self.METHODS}
        if unknown:
            raise TypeError(f"unknown hook(s) {sorted(unknown)}")
        self.units = list(units)
        self._installed: list[tuple[object, str]] = []
        for unit in self.units:
            for method in self.METHODS:
                pre, post = callbacks.get("pre_" + method), callbacks.get("post_" + method)
                if pre is None and post is None:
                    continue
                if method in unit.module.__dict__:
                    raise RuntimeError(f"{type(unit.module).__name__}.{method} is already hooked; "
                                       f"remove() the other hooks first")
                setattr(unit.module, method, self._wrap(unit, getattr(unit.module, method),
                                                        pre, post))
                self._installed.append((unit.module, method))

    @staticmethod
    def _wrap(unit, inner, pre, post):
        def hooked(*args, **kwargs):
            if pre is not None:
                pre(unit)
            out = inner(*args, **kwargs)
            if post is not None:
                post(unit)
            return out
        hooked.__wrapped__ = inner
        return hooked

    def remove(self) -> None:
        for module, method in self._installed:
            module.__dict__.pop(method, None)
        self._installed = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
