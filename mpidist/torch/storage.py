"""The flat buffers that hold a module's trainable parameters and their gradients.

Re-homing, once: the parameters are packed, in the layout's order, into one flat buffer
on their device (NumPy on the CPU, CuPy over torch's memory on a GPU) and each
`param.data` becomes a view of it; each `param.grad` is a view of a flat gradient buffer
of the same layout. Nothing is copied per step. A CPU buffer may live in a node's shared
window (collectives.node.SharedBuffer), where the ranks reduce it in place.
"""
from __future__ import annotations

from mpidist.collectives.node import SharedBuffer
from mpidist.torch.tensors import flat_buffer, from_numpy

__all__ = ["FlatStorage"]


class FlatStorage:
    """params, grads: flat arrays of layout.numel elements of dtype on the parameters'
    device, tparams / tgrads the torch tensors over them; gviews[i] is the torch view of
    parameter i's gradient, gflat[i] the array one.

    shared_grads / shared_params: place that buffer in a SharedBuffer over comm
    (collective); `shared` / `pshared` are then those buffers, else None.
    """

    def __init__(self, params, layout, dtype, comm, *, shared_grads: bool, shared_params: bool):
        self.layout, self.tensors = layout, params
        self.device = params[0].device
        self.shared = SharedBuffer(layout.numel, dtype, comm) if shared_grads else None
        self.pshared = SharedBuffer(layout.numel, dtype, comm) if shared_params else None
        if self.pshared is None:
            self.params, self.tparams = flat_buffer(layout.numel, dtype, self.device)
        else:
            self.params = self.pshared.data
            self.tparams = from_numpy(self.params)
        if self.shared is None:
            self.grads, self.tgrads = flat_buffer(layout.numel, dtype, self.device)
        else:
            self.grads = self.shared.data
            self.tgrads = from_numpy(self.grads)
        tp, tg = self.tparams, self.tgrads
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
        self.tgrads.zero_()
        for p, g in zip(self.tensors, self.gviews):
            p.grad = g

    def release(self) -> None:
        """Collective: move what lives in shared windows into private copies (the views
        follow) and free the windows."""
        if self.shared is not None:
            self.grads = self.grads.copy()
            self.tgrads = tg = from_numpy(self.grads)
            self.gviews = [tg[s.offset:s.stop].view(s.shape) for s in self.layout]
            self.gflat = [self.grads[s.offset:s.stop] for s in self.layout]
            for p, g in zip(self.tensors, self.gviews):
                p.grad = g
            self.shared.free()
            self.shared = None
        if self.pshared is not None:
            self.params = self.params.copy()
            self.tparams = tp = from_numpy(self.params)
            for s, p in zip(self.layout, self.tensors):
                p.data = tp[s.offset:s.stop].view(s.shape)
            self.pshared.free()
            self.pshared = None
