"""Module: the layer protocol every mpidist model follows.

A module declares its parameters as (name, shape) pairs; the caller lays them out in one flat
buffer (mpidist.flat) and binds views of it, so parameters and gradients are never copied:
the optimizer and the allreduce work on the flat buffers, the layers on the views (the
protocol is listed in Module's docstring). Backward runs in reverse layer order, so
grad-ready reports arrive from the end of the flat buffer towards its start; the
DistributedOptimizer launches each gradient bucket from them. See docs/ARCHITECTURE.md (nn).
"""
from __future__ import annotations

import numpy as np

from mpidist.flat import FlatBuffer, Layout
from mpidist.kernels.backend import get_array_module

__all__ = ["Module", "Sequential", "materialize"]


class Module:
    """Base class: leaf layers list `_params`; containers list `_children`.

    model.param_shapes() -> [(name, shape)]          # layout order = forward order
    model.bind(param_views, grad_views)              # {name: view}, both from Layout.views
    model.init_params(rng)                           # writes initial values into the views
    y = model.forward(x, train=True)
    dx = model.backward(dy)                          # ACCUMULATES into the grad views
    model.set_grad_hook(fn)                          # fn(names) once those grads are final
    model.no_input_grad()                            # inputs are data: skip d(input), return None
    """

    def __init__(self):
        self._params: list[tuple[str, tuple[int, ...]]] = []
        self._children: list[tuple[str, Module]] = []
        self.p: dict = {}
        self.g: dict = {}
        self._hook = None
        self._full_names: list[str] = []
        self.input_grad = True          # False: backward returns None, skipping d(input)

    # -- declaration ------------------------------------------------------------------
    def add_param(self, name: str, shape) -> None:
        """Declare a parameter of this leaf layer (bound later by bind())."""
        self._params.append((name, tuple(int(s) for s in shape)))

    def add_child(self, name: str, module: Module) -> Module:
        """Register a sub-module; its parameters are named `name.<its names>`."""
        if not isinstance(module, Module):
            raise TypeError(f"child {name!r} must be an mpidist.nn.Module, got {type(module).__name__}")
        self._children.append((name, module))
        return module

    def children(self) -> list[tuple[str, Module]]:
        """(name, module) of the registered sub-modules, in forward order."""
        return list(self._children)

    def param_shapes(self, prefix: str = "") -> list[tuple[str, tuple[int, ...]]]:
        """(full name, shape) of every parameter, in forward order."""
        out = [(prefix + n, s) for n, s in self._params]
        for cname, child in self._children:
            out += child.param_shapes(prefix + cname + ".")
        return out

    def num_params(self) -> int:
        return int(sum(int(np.prod(s)) for _, s in self.param_shapes()))

    # -- binding ----------------------------------------------------------------------
    def bind(self, params: dict, grads: dict, prefix: str = "") -> Module:
        """Point every parameter and gradient at the given views (by full name)."""
        missing = [prefix + n for n, _ in self._params if prefix + n not in params or prefix + n not in grads]
        if missing:
            raise ValueError(f"bind: no view for {missing}; build the views from this model's param_shapes()")
        for n, shape in self._params:
            p, g = params[prefix + n], grads[prefix + n]
            if tuple(p.shape) != shape or tuple(g.shape) != shape:
                raise ValueError(f"bind: {prefix + n} has shape {shape}, views have {p.shape} / {g.shape}")
            self.p[n], self.g[n] = p, g
        self._full_names = [prefix + n for n, _ in self._params]
        for cname, child in self._children:
            child.bind(params, grads, prefix + cname + ".")
        return self

    def init_params(self, rng: np.random.Generator) -> None:
        """Fill the bound parameters with initial values drawn from rng (forward order)."""
        self.reset(rng)
        for _, child in self._children:
            child.init_params(rng)

    def reset(self, rng: np.random.Generator) -> None:
        """Leaf layers with parameters override this."""

    def generators(self) -> list[np.random.Generator]:
        """The random generators (dropout masks) of this module and its children, in module
        order: restoring their states makes a resumed run draw the masks it would have drawn."""
        own = [v for v in vars(self).values() if isinstance(v, np.random.Generator)]
        return own + [g for _, child in self._children for g in child.generators()]

    def _set(self, name: str, values: np.ndarray) -> None:
        view = self.p[name]
        view[...] = get_array_module(view).asarray(values, dtype=view.dtype)

    # -- grad-ready reports -----------------------------------------------------------
    def set_grad_hook(self, fn) -> None:
        """fn(list of full parameter names) is called when those gradients are final."""
        self._hook = fn
        for _, child in self._children:
            child.set_grad_hook(fn)

    def _grads_ready(self) -> None:
        if self._hook is not None and self._full_names:
            self._hook(self._full_names)

    def no_input_grad(self) -> Module:
        """The model's inputs are data: its first layer skips computing their gradient.

        Containers pass this to their first child; a layer with no cheaper path ignores it.
        backward() then returns None.
        """
        self.input_grad = False
        if self._children:
            self._children[0][1].no_input_grad()
        return self

    # -- compute ----------------------------------------------------------------------
    def forward(self, x, train: bool = True):
        raise NotImplementedError(f"{type(self).__name__} must define forward")

    def backward(self, dy):
        raise NotImplementedError(f"{type(self).__name__} must define backward")

    def __call__(self, x, train: bool = True):
        return self.forward(x, train)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={m!r}" for n, m in self._children)
        return f"{type(self).__name__}({inner})"


class Sequential(Module):
    """Layers applied in order; backward in reverse order."""

    def __init__(self, *layers, names=None):
        super().__init__()
        names = names or [str(i) for i in range(len(layers))]
        if len(names) != len(layers):
            raise ValueError("Sequential: give one name per layer")
        for n, layer in zip(names, layers):
            self.add_child(n, layer)

    @property
    def layers(self) -> list[Module]:
        return [m for _, m in self._children]

    def forward(self, x, train: bool = True):
        for layer in self.layers:
            x = layer.forward(x, train)
        return x

    def backward(self, dy):
        for layer in reversed(self.layers):
            dy = layer.backward(dy)
        return dy if self.input_grad else None


def materialize(model: Module, *, dtype=np.float32, xp=np, seed: int = 0):
    """Lay the model out in one parameter and one gradient FlatBuffer, bind and initialise.

    Returns (layout, params, grads). Gradients start at zero.
    """
    layout = Layout(model.param_shapes())
    params = FlatBuffer(layout, dtype=dtype, xp=xp)
    grads = FlatBuffer(layout, dtype=dtype, xp=xp)
    grads.data[...] = 0
    model.bind(params.views(), grads.views())
    model.init_params(np.random.default_rng(seed))
    return layout, params, grads
