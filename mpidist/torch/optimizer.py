"""DistributedOptimizer for torch modules: gradients reduced while backward runs, then one
fused update over flat buffers.

    model = Net()
    opt = mpidist.torch.DistributedOptimizer(model, "adamw", lr=1e-3)   # or torch.optim.AdamW(...)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

Shaped like Horovod's torch optimizer (hooks, asynchronous handles, step() waits first):

  * Re-homing, once. The trainable parameters are packed, in the module's order, into one
    flat NumPy buffer and each `param.data` becomes a view of it; each `param.grad` is a
    view of a flat gradient buffer of the same layout. Nothing is copied per step.
  * During backward, `register_post_accumulate_grad_hook` reports each gradient final. A
    gradient autograd handed over as a new tensor (after zero_grad(set_to_none=True)) is
    copied into its view and checked for Inf/NaN in the same pass; `.grad` is then the view
    again. The flat buffer is cut into buckets from its end (backward reaches the last layer
    first, as in mpidist.engine.distributed.make_buckets); a bucket is launched with
    allreduce_async once all its gradients are final and all buckets before it are
    launched, so every rank launches the same buckets in the same order.
  * step(): 1. launch what is left (parameters that got no gradient count as zero, as in
    DDP), 2. agree on finiteness with one small allreduce of the flags found in the hooks
    (no pass over the gradients), 3. wait for the buckets, 4. update: the mpidist
    optimizer's fused kernel over the flat buffers (op="avg" folds 1/size into it), or the
    wrapped torch optimizer on the `.grad` views. Non-finite gradients skip the update on
    every rank.

Gradient accumulation: backward_passes_per_step=k sums k backward passes (as torch does)
before the buckets go out; step() is called once per k passes. Frozen parameters
(requires_grad=False) stay where they are and are only broadcast.
"""
from __future__ import annotations

import numbers
import time

import numpy as np
import torch
from mpi4py import MPI

from mpidist.collectives import allgather, allreduce_async, reduce_scatter
from mpidist.collectives.window import SharedBuffer
from mpidist.comm import as_communicator
from mpidist.engine.distributed import make_buckets
from mpidist.errors import MismatchError
from mpidist.flat import Layout
from mpidist.kernels.grads_cpu import all_finite, copy_finite
from mpidist.optim import Optimizer as FlatOptimizer
from mpidist.optim import build_optimizer
from mpidist.partition import chunk
from mpidist.torch.tensors import from_numpy, numpy_dtype, to_numpy

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
           "named_parameters"]

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


def _check_params(named, optimizer) -> None:
    """The local checks of the parameters (TypeError/ValueError saying what to do)."""
    if not named:
        raise ValueError("the model has no parameters")
    seen: dict = {}
    for name, p in named:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {name!r} is a {type(p).__name__}, not a torch tensor")
        if p.data_ptr() in seen and p.numel() > 0:
            raise ValueError(f"parameter {name!r} is the same tensor as {seen[p.data_ptr()]!r}; "
                             f"pass each parameter once (model.parameters() removes duplicates)")
        seen[p.data_ptr()] = name
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise ValueError("no parameter requires grad; unfreeze some (requires_grad=True)")
    devices = sorted({str(p.device) for _, p in trainable})
    if len(devices) > 1:
        where = {d: next(n for n, p in trainable if str(p.device) == d) for d in devices}
        raise ValueError(f"the parameters live on several devices ({where}); a gradient "
                         f"bucket holds one device: move the model with model.to(device)")
    if devices[0] != "cpu":
        raise ValueError(f"parameters on {devices[0]}: this DistributedOptimizer trains CPU "
                         f"tensors; run the model on the CPU")
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


def _check_same_params(c, named) -> None:
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


def _bcast_tensor(c, t: torch.Tensor, root: int) -> None:
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
    _check_same_params(c, [(n, t) for n, t in named])
    for _, t in named:
        if t.numel():
            _bcast_tensor(c, t.data, root_rank)


def broadcast_optimizer_state(optimizer, root_rank: int = 0, comm=None) -> None:
    """Collective: every rank takes root_rank's optimizer state (a DistributedOptimizer,
    an mpidist flat optimizer or a torch optimizer)."""
    if isinstance(optimizer, DistributedOptimizer):
        if optimizer.zero:
            raise ValueError("under ZeRO each rank holds its own shard of the optimizer "
                             "state: there is nothing to broadcast (checkpoint it instead)")
        comm = optimizer.comm if comm is None else comm
        optimizer = optimizer.optimizer
    c = as_communicator(comm)
    if isinstance(optimizer, FlatOptimizer):
        sd = optimizer.state_dict()
        for _, b in sorted(sd["state"].items()):
            c.comm.Bcast(b, root=root_rank)
        sd["step"] = c.comm.bcast(sd["step"], root=root_rank)
        optimizer.load_state_dict(sd)
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a DistributedOptimizer, an mpidist optimizer or a "
                        f"torch.optim.Optimizer, got {type(optimizer).__name__}")
    state = c.comm.bcast(optimizer.state_dict() if c.rank == root_rank else None, root=root_rank)
    if c.rank != root_rank:
        optimizer.load_state_dict(state)


class DistributedOptimizer:
    """Data-parallel training of a torch module over an MPI communicator.

    model: a torch.nn.Module, or its named_parameters() (or a list of parameters).
    optimizer: an mpidist optimizer name ("sgd", "adamw", "lars", "lamb") whose
      hyperparameters come as keyword arguments (**hyper), an mpidist flat optimizer or a
      callable(layout) -> one, or any torch.optim.Optimizer over the model's parameters.
    op: "avg" (the mean of the ranks' gradients, each rank's loss a mean over its own
      batch, as Horovod) or "sum".
    algorithm: the mpidist.collectives allreduce algorithm ("auto", "ring", "tree", ...).
    bucket_mb: gradient bucket size in MiB (0: one bucket after backward).
    backward_passes_per_step: backward passes summed into each step (accumulation).
    compression: None or a compressor name of mpidist.compress, with compression_options.
    zero: 0 (data parallel), 1 (ZeRO stage 1: each rank keeps and updates the optimizer
      state of its shard, chunk(numel, rank, size), then the shards are allgathered) or 2
      (stage 2: the buckets are reduce-scattered onto the shards' owners, not allreduced).
      torch's autograd still writes whole gradients, so stage 2 saves communication, not
      gradient memory. Needs an mpidist optimizer.
    broadcast: start from rank 0's parameters, frozen parameters, buffers and optimizer state.
    Construction is collective.
    """

    def __init__(self, model, optimizer="sgd", *, comm=None, op: str = "avg",
                 algorithm: str = "auto", bucket_mb: float = 4.0,
                 backward_passes_per_step: int = 1, compression: str | None = None,
                 compression_options: dict | None = None, zero: int = 0, broadcast: bool = True,
                 **hyper):
        self.comm = c = as_communicator(comm)
        error = None
        try:
            named = named_parameters(model)
            _check_params(named, optimizer)
            if op not in ("avg", "sum"):
                raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
            k = backward_passes_per_step
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
            if hyper and not isinstance(optimizer, str):
                raise TypeError(f"hyperparameters {sorted(hyper)} go with an optimizer name "
                                f"(e.g. DistributedOptimizer(model, 'adamw', lr=1e-3))")
        except (TypeError, ValueError) as exc:
            error = exc
        c.raise_if_any(error)
        _check_same_params(c, named)
        opt_name = optimizer if isinstance(optimizer, str) else type(optimizer).__name__
        c.check_same((op, algorithm, float(bucket_mb), int(backward_passes_per_step),
                      compression, sorted((compression_options or {}).items()), opt_name, zero),
                     "DistributedOptimizer settings (op, algorithm, bucket_mb, "
                     "backward_passes_per_step, compression, compression_options, optimizer, "
                     "zero)")
        self.zero = int(zero)
        self.op, self.algorithm = op, algorithm
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.params = [p for _, p in named if p.requires_grad]
        self.frozen = [p for _, p in named if not p.requires_grad]
        self.layout = Layout((n, tuple(p.shape)) for n, p in named if p.requires_grad)
        dtype = numpy_dtype(self.params[0].dtype)
        # gradients in a node's shared window are reduced where they lie (no copy in)
        window = compression in (None, "none") and algorithm == "auto" and \
            SharedBuffer.usable(c, dtype)
        self.shared = SharedBuffer(self.layout.numel, dtype, c) if window else None
        self.pshared = SharedBuffer(self.layout.numel, dtype, c) if window and zero else None
        n = self.layout.numel
        offset, count = chunk(n, c.rank, c.size) if zero else (0, n)
        self.shard = (offset, offset + count)       # the range this rank's optimizer updates
        self.bounds = [chunk(n, r, c.size)[0] for r in range(c.size)] + [n]
        self._rehome(dtype)
        self.optimizer = self._build_optimizer(optimizer, hyper)
        self.compressed = None
        if compression not in (None, "none"):
            from mpidist.compress import CompressedAllreduce, build_compressor
            self.compressed = CompressedAllreduce(
                build_compressor(compression, **(compression_options or {})), c,
                nonfinite="skip")
        elif compression_options:
            raise ValueError("compression_options need a compression name")
        self.buckets = make_buckets(self.layout, self.flat_grads.dtype.itemsize, bucket_mb)
        self._bucket_of = np.empty(len(self.layout), np.int64)
        for b, (lo, hi) in enumerate(self.buckets):
            for index, _, _ in self.layout.clip(lo, hi):
                self._bucket_of[index] = b
        self._size_of = np.bincount(self._bucket_of, minlength=len(self.buckets))
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                       for i, p in enumerate(self.params)]
        self._new_round()
        self.last_step: dict = {}
        if broadcast:
            c.comm.Bcast(self.flat_params.view(np.uint8), root=0)
            for t in self.frozen:
                _bcast_tensor(c, t.data, 0)
            if isinstance(model, torch.nn.Module):
                for _, b in model.named_buffers():
                    _bcast_tensor(c, b.data, 0)
            if not self.zero:                # ZeRO: each rank holds its own shard's state
                broadcast_optimizer_state(self.optimizer, 0, c)

    # ------------------------------------------------------------------ set-up
    def _rehome(self, dtype) -> None:
        """Move every trainable parameter and its gradient into the flat buffers."""
        self.flat_params = np.empty(self.layout.numel, dtype) if self.pshared is None \
            else self.pshared.data
        self.flat_grads = np.zeros(self.layout.numel, dtype) if self.shared is None \
            else self.shared.data
        tp, tg = from_numpy(self.flat_params), from_numpy(self.flat_grads)
        self._gviews, self._gflat = [], []
        for s, p in zip(self.layout, self.params):
            view = tp[s.offset:s.stop].view(s.shape)
            view.copy_(p.detach())
            p.data = view
            gview = tg[s.offset:s.stop].view(s.shape)
            if p.grad is not None:
                gview.copy_(p.grad)
            p.grad = gview
            self._gviews.append(gview)
            self._gflat.append(self.flat_grads[s.offset:s.stop])

    def _build_optimizer(self, optimizer, hyper):
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        a, b = self.shard
        if isinstance(optimizer, str):
            opt = build_optimizer(optimizer, self.layout, offset=a, count=b - a,
                                  param_dtype=self.flat_params.dtype, **hyper)
        elif isinstance(optimizer, FlatOptimizer):
            opt = optimizer
        elif callable(optimizer):
            opt = optimizer(self.layout)
        else:
            raise TypeError(f"optimizer must be a name, an mpidist optimizer, a "
                            f"callable(layout) or a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if not isinstance(opt, FlatOptimizer) or opt.layout != self.layout or \
                (opt.offset, opt.count) != (a, b - a):
            raise ValueError(f"the mpidist optimizer must cover [{a}, {b}) of this model's "
                             f"layout (DistributedOptimizer.layout, .shard)")
        return opt

    # ------------------------------------------------------------------ backward
    def _new_round(self) -> None:
        self._passes = np.zeros(len(self.params), np.int64)
        self._pending = self._size_of.copy()
        self._handles: list = []
        self._finite = True
        self._synced = None
        self._errors: list[str] = []
        self._t_launch = 0.0

    def _hook(self, i: int):
        def hook(p):
            self._grad_final(i, p, from_hook=True)
        return hook

    def _grad_final(self, i: int, p, from_hook: bool) -> None:
        """A backward pass has finished p's gradient (or step() finalises it)."""
        gview, g = self._gviews[i], p.grad
        if from_hook:
            self._passes[i] += 1
        final = self._passes[i] >= self.backward_passes_per_step or not from_hook
        if self._passes[i] > self.backward_passes_per_step:
            self._errors.append(f"parameter {self.layout.names[i]!r} got more than "
                                f"backward_passes_per_step={self.backward_passes_per_step} "
                                f"gradients before step()")
            return
        ok = None
        if not from_hook:                   # finalised by step(): a partial sum, or nothing
            if g is None or self._passes[i] == 0:
                gview.zero_()               # no gradient this round counts as zero (as DDP)
                ok = True
            self._passes[i] = self.backward_passes_per_step
            g = p.grad = gview
        elif g is not gview and g.data_ptr() != gview.data_ptr():
            if final and g.is_contiguous() and g.dtype == gview.dtype and g.device.type == "cpu":
                ok = copy_finite(self._gflat[i], to_numpy(g).reshape(-1))
            else:
                gview.copy_(g)
            p.grad = gview
        if not final:
            return
        if ok is None:
            ok = all_finite(self._gflat[i])
        self._finite &= bool(ok)
        self._pending[self._bucket_of[i]] -= 1
        self._launch()

    def _launch(self) -> None:
        t0 = time.perf_counter()
        while len(self._handles) < len(self.buckets) and self._pending[len(self._handles)] == 0:
            lo, hi = self.buckets[len(self._handles)]
            buf = self.flat_grads[lo:hi]
            if self.comm.size == 1:
                h = None
            elif self.zero == 2:             # without the window: one reduce-scatter in step()
                h = None if self.shared is None else \
                    self.shared.reduce_scatter_async(lo, hi, self.shard)
            elif self.shared is not None:
                h = self.shared.allreduce_async(lo, hi)
            elif self.compressed is not None:
                h = self.compressed.allreduce_async(buf, op="sum", layout=self.layout)
            else:
                h = allreduce_async(buf, op="sum", algorithm=self.algorithm, comm=self.comm)
            self._handles.append((buf, h))
        self._t_launch += time.perf_counter() - t0

    # ------------------------------------------------------------------ the step
    def synchronize(self) -> bool:
        """Launch what is left, agree on finiteness and wait for every bucket; returns
        whether the summed gradients are finite on every rank (collective)."""
        c = self.comm
        if self._synced is not None:
            return self._synced
        for i, p in enumerate(self.params):
            if self._passes[i] < self.backward_passes_per_step:
                self._grad_final(i, p, from_hook=False)
        flag = np.array([0.0 if self._finite else 1.0, float(len(self._errors))])
        req = c.comm.Iallreduce(MPI.IN_PLACE, flag, op=MPI.SUM) if c.size > 1 else None
        for buf, h in self._handles:
            if h is not None:
                out = h.wait()
                if self.compressed is not None:      # a new array: the compressed sum
                    buf[...] = out
        if req is not None:
            req.Wait()
        if self.shared is not None:
            self.shared.fence()             # nobody reads my gradients any more
        elif self.zero == 2 and c.size > 1:
            a, b = self.shard
            reduce_scatter(self.flat_grads, op="sum", comm=c, out=self.flat_grads[a:b],
                           algorithm="auto" if self.algorithm == "auto" else "ring")
        if flag[1] > 0:                     # every bucket went out and came back first
            error = RuntimeError("; ".join(self._errors)) if self._errors else None
            self._new_round()
            c.raise_if_any(error)
        self._synced = bool(flag[0] == 0.0)
        return self._synced

    def step(self, closure=None):
        """Wait for the gradients, then update (skipped on every rank when any gradient is
        Inf/NaN). Returns the closure's loss, if a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = time.perf_counter()
        finite = self.synchronize()
        t1 = time.perf_counter()
        scale = float(self.comm.size) if self.op == "avg" else 1.0
        info = {"skipped": not finite}
        if finite:
            if isinstance(self.optimizer, torch.optim.Optimizer):
                if scale != 1.0:
                    from_numpy(self.flat_grads).mul_(1.0 / scale)
                self.optimizer.step()
            else:
                a, b = self.shard
                out = self.optimizer.step(self.flat_params[a:b], self.flat_grads[a:b],
                                          finite=True, loss_scale=scale,
                                          reduce_norms=self._reduce_norms if self.zero else None)
                info.update(lr=out.lr, optim_step=out.step)
                if self.zero and self.comm.size > 1:
                    self._gather_params()
        t2 = time.perf_counter()
        self.last_step = {**info, "t_launch": self._t_launch, "t_wait": t1 - t0,
                          "t_optim": t2 - t1}
        self._new_round()
        return loss

    def _reduce_norms(self, partials):
        """LARS/LAMB under ZeRO: per-tensor partial sums of squares summed over shards."""
        if self.comm.size > 1:
            self.comm.comm.Allreduce(MPI.IN_PLACE, partials, op=MPI.SUM)
        return partials

    def _gather_params(self) -> None:
        """ZeRO: every rank's updated shard into every rank's whole parameter buffer."""
        if self.pshared is not None:
            self.pshared.allgather(self.bounds)
        else:
            a, b = self.shard
            allgather(self.flat_params[a:b].copy(), out=self.flat_params, comm=self.comm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients. set_to_none: `.grad` becomes None until the next backward
        puts it back into the flat buffer (as torch's default); else the views are zeroed."""
        if set_to_none:
            for p in self.params:
                p.grad = None
        else:
            from_numpy(self.flat_grads).zero_()
            for p, g in zip(self.params, self._gviews):
                p.grad = g
        self._new_round()

    # ------------------------------------------------------------------ torch-like access
    @property
    def param_groups(self):
        """The torch optimizer's param_groups (a torch optimizer wrapped), else one group
        with the mpidist optimizer's lr."""
        if isinstance(self.optimizer, torch.optim.Optimizer):
            return self.optimizer.param_groups
        return [{"params": self.params, "lr": self.optimizer.lr}]

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def close(self) -> None:
        """Collective: detach from the model's backward and free the shared window (the
        gradients then live in a private copy; the parameters stay in the flat buffer)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.shared is not None:
            grads = self.flat_grads.copy()
            tg = from_numpy(grads)
            for s, p in zip(self.layout, self.params):
                p.grad = tg[s.offset:s.stop].view(s.shape)
            self.flat_grads = grads
            self.shared.free()
            self.shared = None
        if self.pshared is not None:
            params = self.flat_params.copy()
            tp = from_numpy(params)
            for s, p in zip(self.layout, self.params):
                p.data = tp[s.offset:s.stop].view(s.shape)
            self.flat_params = params
            self.pshared.free()
            self.pshared = None

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({len(self.params)} tensors, {self.layout.numel} "
                f"elements, {len(self.buckets)} buckets, ranks={self.comm.size}, "
                f"optimizer={type(self.optimizer).__name__})")
