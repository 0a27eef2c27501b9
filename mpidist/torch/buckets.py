"""Gradient buckets launched while backward runs, in the same order on every rank.

`register_post_accumulate_grad_hook` reports each gradient final. A gradient autograd
handed over as a new tensor (after zero_grad(set_to_none=True)) is copied into its view
of the flat gradient buffer and checked for Inf/NaN in the same pass; `.grad` is then the
view again. Where the exchange sums in the node's shared window, which checks the sums as
it makes them, a gradient's part in this rank's own chunk of its bucket (which no other
rank reads) is not copied: the launch reads it from autograd's tensor and the sum lands in
the view. The flat buffer is cut into buckets from its end (backward reaches the last
layer first, as in mpidist.engine.distributed.make_buckets); a bucket is launched once all
its gradients are final and all buckets before it are launched, so every rank launches the
same buckets in the same order. What a launch does is the exchange's business
(mpidist.torch.exchange): allreduce, reduce-scatter, or nothing.

Gradient accumulation: with passes_per_step=k, a parameter's gradient is final after its
k-th backward pass (torch sums them); a parameter that got fewer by step() counts as
what it has (zero if none, as in DDP). While `sync` is off (DistributedOptimizer.no_sync)
the hooks stand aside and torch accumulates as it always does; the next synced pass
counts all of it.

Gradients are read by the reduction from the moment their bucket launches, so nothing may
change them before synchronize(): a change in place (clip_grad_norm_ straight after
backward, as in a DDP script) or a `.grad` replaced after backward is found
there (the flat buffer's version counter, which torch bumps on every in-place write to a
view, against its value after the last hook; the views' identity) and raised on every rank,
with the step not taken, instead of reducing half-changed gradients and parting the ranks.
So is a parameter frozen when the buckets were made and unfrozen since: nothing would
reduce or update it.

Averages: each gradient is multiplied by `scale` (1/size for an average) as it becomes
final, in the pass that copies it into the buffer where there is one, so the reduction's
sum is the average itself and no pass over the buffer follows. A parameter with no
gradient on any rank (`.grad` None everywhere) gets `.grad` None back after the
reduction (`unused`), as one process on the whole batch would have it.

CUDA parameters: the copies, scaling and Inf/NaN checks are torch's operations on the
device (the checks accumulate in a device flag read once, when every gradient is final);
a bucket's launch is queued on torch's current stream (mpidist.torch.tensors.torch_stream),
so MPI reads it after backward wrote it, without stopping backward to wait.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from mpi4py import MPI

from mpidist.engine.distributed import make_buckets
from mpidist.kernels.grads_cpu import all_finite, copy_finite, copy_scaled_finite
from mpidist.torch.tensors import device_synchronize, to_numpy, torch_stream

__all__ = ["GradientBuckets"]


def _scaled_copy(dst, src, s: float) -> None:
    """dst = src * s in one compiled pass (the window checks the sums for Inf/NaN later;
    NumPy's multiply by a Python float is several times slower on large float32 arrays)."""
    if s == 1.0:
        np.copyto(dst, src)
    elif src.dtype.itemsize >= 4:
        copy_scaled_finite(dst, src, s)
    else:
        np.multiply(src, src.dtype.type(s), out=dst)


class GradientBuckets:
    """The hooks on params (torch tensors whose `.grad` views storage.gflat / gviews) and
    the ordered launches of their buckets through exchange.launch(lo, hi) -> handle|None.

    After synchronize(): every bucket launched and waited for, exchange.complete() run, and
    whether every rank's gradients were finite (collective)."""

    def __init__(self, params, layout, storage, exchange, comm, *, bucket_mb: float,
                 passes_per_step: int, scale: float = 1.0, frozen=()):
        self.params, self.layout, self.storage = params, layout, storage
        self.frozen = list(frozen)              # (name, parameter): not in the buckets
        self.joined = False                     # this rank shadows the others (join())
        self.active = comm.size                 # ranks not joined, as of the last step
        self.scale, self.sync = float(scale), True
        self.exchange, self.comm, self.passes_per_step = exchange, comm, passes_per_step
        self.device = storage.device
        self.buckets = make_buckets(layout, storage.grads.dtype.itemsize, bucket_mb)
        self._bucket_of = np.empty(len(layout), np.int64)
        for b, (lo, hi) in enumerate(self.buckets):
            for index, _, _ in layout.clip(lo, hi):
                self._bucket_of[index] = b
        self._size_of = np.bincount(self._bucket_of, minlength=len(self.buckets))
        self._own_part = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                       for i, p in enumerate(params)]
        self.new_round()

    def new_round(self) -> None:
        """Forget this round's gradients (after a step, or zero_grad)."""
        self._window = self.exchange.in_window()
        if self._window and self._own_part is None:
            self._own_part = self._own_parts()
        self._own: list[list] = [[] for _ in self.buckets]
        self._passes = np.zeros(len(self.params), np.int64)
        self._had = np.ones(len(self.params))     # 0: .grad was None when finalised
        self.unused = np.zeros(len(self.params), bool)
        self._pending = self._size_of.copy()
        self._handles: list = []
        self._finite = True
        self._finite_dev = None                 # CUDA: the device's Inf/NaN flag
        self._synced = None
        self._flag, self._flag_req = None, None
        self._errors: list[str] = []
        self._version = None                # the buffer's version after the last hook
        self.t_launch = 0.0
        self.launched_at: list[float] = []      # per bucket: when it could launch (perf_counter)

    @property
    def synced(self) -> bool:
        """Whether this round's buckets have been waited for (synchronize() ran)."""
        return self._synced is not None

    @property
    def in_flight(self) -> bool:
        """Whether buckets of this round are launched and not yet waited for."""
        return bool(self._handles) and self._synced is None

    @property
    def backward_done(self) -> bool:
        """Whether every bucket of this round is launched (every gradient final) and not yet
        waited for."""
        return len(self._handles) == len(self.buckets) and self._synced is None

    def remove(self) -> None:
        """Detach from the model's backward."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _own_parts(self) -> list:
        """Per parameter: (x, y, start), its elements [x, y) in the exchange's owned part of
        its bucket (start: where x lies in the buffer), or None."""
        parts = []
        for i, s in enumerate(self.layout):
            a, b = self.exchange.owned(*self.buckets[self._bucket_of[i]])
            x, y = max(a, s.offset) - s.offset, min(b, s.stop) - s.offset
            parts.append((x, y, s.offset + x) if x < y else None)
        return parts

    def _copy_around_own(self, i: int, src) -> None:
        """Copy gradient i into the buffer but for its owned part, which the launch reads."""
        dst, part, s = self.storage.gflat[i], self._own_part[i], self.scale
        if part is None:
            _scaled_copy(dst, src, s)
            return
        x, y, start = part
        for a, b in ((0, x), (y, src.shape[0])):
            _scaled_copy(dst[a:b], src[a:b], s)
        if s != 1.0:                        # autograd's own tensor: nobody else reads it
            _scaled_copy(src[x:y], src[x:y], s)
        self._own[self._bucket_of[i]].append((start, src[x:y]))

    def _hook(self, i: int):
        def hook(p):
            if self.sync:
                self._grad_final(i, p, from_hook=True)
                self._version = self.storage.tgrads._version
        return hook

    def _touched(self) -> str | None:
        """What changed the gradients after backward and before synchronize(), or None."""
        late = [n for n, p in self.frozen if p.requires_grad]
        if late:
            return (f"parameter {late[0]!r}" + (f" and {len(late) - 1} more" if len(late) > 1
                                               else "") +
                    " was frozen (requires_grad=False) when the DistributedOptimizer was built "
                    "and requires grad now: it is not in the flat buffers, so nothing would "
                    "reduce or update its gradient. After unfreezing, close() the "
                    "DistributedOptimizer and build a new one; this step is not taken")
        if self._version is None:
            return None
        changed = [self.layout.names[i] for i, (p, g) in enumerate(zip(self.params,
                                                                        self.storage.gviews))
                   if self._passes[i] >= self.passes_per_step and
                   (p.grad is None or p.grad.data_ptr() != g.data_ptr())]
        if changed:
            what = f"`.grad` of {changed[0]!r}" + (f" and {len(changed) - 1} more"
                                                    if len(changed) > 1 else "") + " replaced"
        elif self.storage.tgrads._version != self._version:
            what = "written in place"
        else:
            return None
        return (f"the gradients were changed after backward() and before synchronize() "
                f"({what}): they are reduced while backward runs, so until "
                f"opt.synchronize() (or opt.step()) returns `.grad` is still being read. "
                f"Call opt.synchronize() first, then clip_grad_norm_ or any other change of "
                f"the gradients (GradScaler.unscale_(opt) waits by itself); this step is not "
                f"taken")

    def _grad_final(self, i: int, p, from_hook: bool) -> None:
        """A backward pass has finished p's gradient (or synchronize() finalises it)."""
        gview, g = self.storage.gviews[i], p.grad
        k = self.passes_per_step
        if from_hook:
            self._passes[i] += 1
        final = self._passes[i] >= k or not from_hook
        if self._passes[i] > k:
            self._errors.append(f"parameter {self.layout.names[i]!r} got more than "
                                f"backward_passes_per_step={k} gradients before step() "
                                f"(to drop a backward's gradients without a step, call "
                                f"opt.zero_grad(): it waits for their reduction first)")
            return
        ok, s = None, self.scale
        if not from_hook:                   # finalised by step(): a partial sum, or nothing
            if g is None:
                gview.zero_()               # no gradient this round counts as zero (as DDP)
                ok, self._had[i] = True, 0.0
            else:                           # a partial sum, or what no_sync accumulated
                if g.data_ptr() != gview.data_ptr():
                    gview.copy_(g)
                if s != 1.0:
                    gview.mul_(s)
            self._passes[i] = k
            g = p.grad = gview
        elif g is not gview and g.data_ptr() != gview.data_ptr():
            if final and g.is_contiguous() and g.dtype == gview.dtype and g.device.type == "cpu":
                src = to_numpy(g).reshape(-1)
                if self._window:            # the window's sum checks it
                    self._copy_around_own(i, src)
                elif s != 1.0 and src.dtype.itemsize >= 4:
                    ok = copy_scaled_finite(self.storage.gflat[i], src, s)
                elif s != 1.0:
                    torch.mul(g, s, out=gview)
                else:
                    ok = copy_finite(self.storage.gflat[i], src)
            else:
                gview.copy_(g)
                if final and s != 1.0:
                    gview.mul_(s)
            p.grad = gview
        elif final and s != 1.0:            # accumulated into the view: scaled where it lies
            gview.mul_(s)
        if not final:
            return
        if self.device.type == "cuda":
            fin = torch.isfinite(self.storage.gviews[i]).all()
            self._finite_dev = fin if self._finite_dev is None else self._finite_dev & fin
        elif not self._window:
            self._finite &= bool(all_finite(self.storage.gflat[i]) if ok is None else ok)
        self._pending[self._bucket_of[i]] -= 1
        self._launch()

    def _launch(self) -> None:
        if len(self._handles) == len(self.buckets) or self._pending[len(self._handles)]:
            return                          # the next bucket is not final yet (most hooks)
        t0 = time.perf_counter()
        with torch_stream(self.device):
            while len(self._handles) < len(self.buckets) and \
                    self._pending[len(self._handles)] == 0:
                b = len(self._handles)
                lo, hi = self.buckets[b]
                self.launched_at.append(t0)
                self._handles.append(self.exchange.launch(lo, hi, self._own[b]))
                if len(self._handles) == len(self.buckets):
                    self.exchange.launched()
        self.t_launch += time.perf_counter() - t0

    def _post_flags(self) -> None:
        """Start the small allreduce of what every rank must agree on before an update:
        whether its gradients were finite, its errors, whether it has joined, which
        parameters had a gradient.
        Posted once every gradient is final; it is small, so it is back before the first
        bucket is, which the update of that bucket needs."""
        if self._finite_dev is not None:
            self._finite &= bool(self._finite_dev)
        self._flag = np.concatenate([[0.0 if self._finite else 1.0, float(len(self._errors)),
                                      0.0 if self.joined else 1.0], self._had])
        c = self.comm
        self._flag_req = c.comm.Iallreduce(MPI.IN_PLACE, self._flag, op=MPI.SUM) \
            if c.size > 1 else None

    def _agree(self) -> bool:
        """Wait for the flags; mark the parameters no rank had a gradient for. Returns
        whether this rank's step may update (no errors, every rank's gradients finite, and
        this rank has not joined)."""
        if self._flag_req is not None:
            self._flag_req.Wait()
            self._flag_req = None
        self.active = int(self._flag[2])
        self.unused = self._flag[3:] == 0.0
        for i in np.flatnonzero(self.unused):   # no rank had one: None, as torch leaves it
            self.params[i].grad = None
        return self._flag[0] == 0.0 and self._flag[1] == 0.0 and not self.joined

    def synchronize(self, settle: bool = True, each=None) -> bool:
        """Launch what is left, agree on finiteness and wait for every bucket; returns
        whether the summed gradients are finite on every rank (collective). settle: also
        wait until no rank reads my gradients any more (else the caller settles later,
        before writing into them: exchange.settle()). each: called with (lo, hi) of each
        bucket once it is reduced and the ranks have agreed that the step updates, in
        bucket order, while the later buckets are still in flight (the update of what is
        back overlaps the transfer of the rest)."""
        if self._synced is not None:
            if settle:
                self.exchange.settle()
            return self._synced
        touched = self._touched()
        if touched is not None:
            self._errors.append(touched)
        for i, p in enumerate(self.params):
            if self._passes[i] < self.passes_per_step:
                self._grad_final(i, p, from_hook=False)
        self._post_flags()
        agreed = None
        for b, h in enumerate(self._handles):
            if h is not None:
                self.exchange.wait(self.buckets[b], h)
            if each is not None:
                if agreed is None:
                    agreed = self._agree()
                if agreed:
                    each(self.buckets[b])
        device_synchronize(self.device)     # CUDA: the sums are in the buffer, for any stream
        if agreed is None:
            self._agree()
        summed_finite = self.exchange.complete()
        if self._flag[1] > 0:               # every bucket went out and came back first
            error = RuntimeError("; ".join(self._errors)) if self._errors else None
            self.exchange.settle()
            self.new_round()
            self.comm.raise_if_any(error)
        self._synced = bool(self._flag[0] == 0.0) and summed_finite is not False
        if settle:
            self.exchange.settle()
        return self._synced
