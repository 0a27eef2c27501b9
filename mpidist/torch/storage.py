"""The flat buffers that hold a module's trainable parameters and their gradients.

Re-homing, once: the parameters are packed, in the layout's order, into one flat NumPy
buffer and each `param.data` becomes a view of it; each `param.grad` is a view of a flat
gradient buffer of the same layout. Nothing is copied per step. A buffer may live in a
node's shared window (collectives.node.SharedBuffer), where the ranks reduce it in place.
"""
from __future__ import annotations

import numpy as np

from mpidist.collectives.node import SharedBuffer
from mpidist.torch.tensors import from_numpy

__all__ = ["FlatStorage"]


class FlatStorage:
    """params, grads: flat arrays of layout.numel elements of dtype; gviews[i] is the
    torch view of parameter i's gradient, gflat[i] the NumPy one.

    shared_grads / shared_params: place that buffer in a SharedBuffer over comm
    (collective); `shared` / `pshared` are then those buffers, else None.
    """

    def __init__(self, params, layout, dtype, comm, *, shared_grads: bool, shared_params: bool):
        self.layout, self.tensors = layout, params
        self.shared = SharedBuffer(layout.numel, dtype, comm) if shared_grads else None
        self.pshared = SharedBuffer(layout.numel, dtype, comm) if shared_params else None
        self.params = np.empty(layout.numel, dtype) if self.pshared is None else self.pshared.data
        self.grads = np.zeros(layout.numel, dtype) if self.shared is None else self.shared.data
        tp, tg = from_numpy(self.params), from_numpy(self.grads)
        self.gviews, self.gflat = [], []
        for s, p in zip(layout, params):
            view = tp[s.offset:s.stop].view(s.shape)
            view.copy_(p.detach())
            p.data = view
            gview = tg[s.offset:s.stop].view(s.shape)
            if p.grad is not None:
                gview.copy_(p.grad)
            p.grad = gview
            self.gviews.append(gview)
            self.gflat.append(self.grads[s.offset:s.stop])

    def zero_grads(self) -> None:
        """Zero the gradient buffer and point every `.grad` at its view again."""
        from_numpy(self.grads).zero_()
        for p, g in zip(self.tensors, self.gviews):
            p.grad = g

    def release(self) -> None:
        """Collective: move what lives in shared windows into private copies (the views
        follow) and free the windows."""
        if self.shared is not None:
            self.grads = self.grads.copy()
            tg = from_numpy(self.grads)
            self.gviews = [tg[s.offset:s.stop].view(s.shape) for s in self.layout]
            self.gflat = [self.grads[s.offset:s.stop] for s in self.layout]
            for p, g in zip(self.tensors, self.gviews):
                p.grad = g
            self.shared.free()
            self.shared = None
        if self.pshared is not None:
            self.params = self.params.copy()
            tp = from_numpy(self.params)
            for s, p in zip(self.layout, self.tensors):
                p.data = tp[s.offset:s.stop].view(s.shape)
            self.pshared.free()
            self.pshared = None
