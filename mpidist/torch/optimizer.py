"""DistributedOptimizer for torch modules: gradients reduced while backward runs, then one
fused update over flat buffers.

    model = Net()
    opt = mpidist.torch.DistributedOptimizer(model, "adamw", lr=1e-3)   # or torch.optim.AdamW(...)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)                     # a torch optimizer
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.synchronize()                                 # .grad: the average over the ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

Shaped like Horovod's torch optimizer (hooks, asynchronous handles, step() waits first),
out of one piece per concern: params (checks), storage (each param.data and .grad a view of
a flat buffer), buckets (the backward hooks), exchange / zero / onebit (what a bucket's
launch and the update do), torchstate (param_groups and state_dict over an mpidist
optimizer). The steps of step(): DistributedOptimizer.step.
"""
from __future__ import annotations

import contextlib
import time

import torch

from mpidist import threads
from mpidist.collectives import select
from mpidist.collectives.node import SharedBuffer
from mpidist.comm import as_communicator
from mpidist.compress import CompressedAllreduce, make_compressor
from mpidist.compress.hierarchical import NodeCompressedAllreduce, spans_nodes
from mpidist.flat import Layout
from mpidist.optim import Optimizer as FlatOptimizer
from mpidist.optim import build_optimizer
from mpidist.strategy.onebit import is_onebit
from mpidist.torch.buckets import GradientBuckets
from mpidist.torch.bucketwise import BucketSteps, usable
from mpidist.torch.exchange import Allreduce
from mpidist.torch.join import shadow_until_all_joined
from mpidist.torch.onebit import Onebit
from mpidist.torch.params import (bcast_state, bcast_tensor, broadcast_parameters,
                                  check_onebit, check_params, check_same_params, check_settings,
                                  named_parameters)
from mpidist.torch.storage import FlatStorage
from mpidist.torch.tensors import numpy_dtype
from mpidist.torch.torchstate import (GroupSync, delegated, fused_defaults, fused_state_dict,
                                      group_dicts, load_fused_state)
from mpidist.torch.zero import Zero, shard_of

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
           "named_parameters"]


def broadcast_optimizer_state(optimizer, root_rank: int = 0, comm=None) -> None:
    """Collective: every rank takes root_rank's optimizer state (any optimizer here)."""
    if isinstance(optimizer, DistributedOptimizer):
        if optimizer.zero:
            raise ValueError("under ZeRO each rank holds its own shard of the optimizer "
                             "state: there is nothing to broadcast (checkpoint it instead)")
        comm = optimizer.comm if comm is None else comm
        optimizer = optimizer.optimizer
    bcast_state(as_communicator(comm), optimizer, root_rank)


class DistributedOptimizer(torch.optim.Optimizer):
    """Data-parallel training of a torch module over an MPI communicator; a torch optimizer
    (schedulers, param_groups, state_dict, step hooks work as with any other).

    model: a torch.nn.Module, or its named_parameters() (or a list of parameters).
    optimizer: an mpidist optimizer name ("sgd", "adamw", "lars", "lamb", "onebit_adam",
      "onebit_lamb") whose hyperparameters come as keyword arguments (**hyper), an mpidist
      flat optimizer or a callable(layout) -> one, or any torch.optim.Optimizer over the
      model's parameters.
    op: "avg" (the mean of the ranks' gradients, each rank's loss a mean over its own
      batch, as DDP and Horovod) or "sum": what `.grad` holds after synchronize().
    algorithm: the mpidist.collectives allreduce algorithm ("auto", "ring", "tree", ...).
    bucket_mb: gradient bucket size in MiB (0: one bucket after backward; compressed
      gradients always go as one).
    backward_passes_per_step: backward passes summed into each step (accumulation).
    compression: None or a compressor name of mpidist.compress, with compression_options
      (the compressor's; "warmup_steps": N sends the first N steps uncompressed, as
      PowerSGD's authors start). On nodes of several ranks only the hop between nodes is
      compressed (mpidist.compress.hierarchical); the sum within a node is exact.
    zero: 0 (data parallel), 1 or 2 (ZeRO stages, mpidist.torch.zero; an mpidist optimizer).
    broadcast: start from rank 0's parameters, frozen parameters, buffers and optimizer state.
    param_groups: with an optimizer name, torch-style groups ({"params": [...], name: value})
      that split the trainable parameters, each with its own lr, weight_decay, betas, ...
    Construction is collective. Frozen parameters (requires_grad=False) stay where they are
    and are only broadcast; one unfrozen later needs a new DistributedOptimizer (step()
    raises until then). Writes into `param_groups` reach the next step.
    """

    _groups = delegated("param_groups")
    state = delegated("state")
    defaults = delegated("defaults")

    def __init__(self, model, optimizer="sgd", *, comm=None, op: str = "avg",
                 algorithm: str = "auto", bucket_mb: float = 4.0,
                 backward_passes_per_step: int = 1, compression: str | None = None,
                 compression_options: dict | None = None, zero: int = 0, broadcast: bool = True,
                 param_groups=None, **hyper):
        self.comm = c = as_communicator(comm)
        threads.configure(c.local_size)     # torch's threads, if torch came after MPI
        error = None
        try:
            named = named_parameters(model)
            check_params(named, optimizer)
            check_settings(optimizer, op, backward_passes_per_step, bucket_mb, zero,
                           compression, compression_options, hyper, param_groups,
                           next(p for _, p in named if p.requires_grad).device)
        except (TypeError, ValueError) as exc:
            error = exc
        c.raise_if_any(error)
        check_same_params(c, named)
        opt_name = optimizer if isinstance(optimizer, str) else type(optimizer).__name__
        c.check_same((op, algorithm, float(bucket_mb), int(backward_passes_per_step),
                      compression, sorted((compression_options or {}).items()), opt_name, zero),
                     "DistributedOptimizer settings (op, algorithm, bucket_mb, "
                     "backward_passes_per_step, compression, compression_options, optimizer, "
                     "zero)")
        self.zero, self.op, self.algorithm = int(zero), op, algorithm
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.params = [p for _, p in named if p.requires_grad]
        self.frozen = [p for _, p in named if not p.requires_grad]
        self.layout = Layout((n, tuple(p.shape)) for n, p in named if p.requires_grad)
        dtype = numpy_dtype(self.params[0].dtype)
        # gradients in a node's shared window are reduced where they lie (no copy in)
        # where auto (the tuned table, or the rule) takes the window for a bucket
        window = compression in (None, "none") and algorithm == "auto" and \
            self.params[0].device.type == "cpu" and \
            SharedBuffer.usable(c, dtype) and \
            select.choose(c, int(bucket_mb * (1 << 20)) or
                          self.layout.numel * dtype.itemsize) == "shm"
        self.storage = FlatStorage(self.params, self.layout, dtype, c, shared_grads=window,
                                   shared_params=window and bool(zero))
        self.shard = shard_of(self.layout.numel, c, self.zero)
        error = None
        try:
            self.optimizer = self._build_optimizer(optimizer, hyper)
            check_onebit(self.optimizer, self.zero, compression, self.storage.device)
            self._init_torch(param_groups)
        except (TypeError, ValueError) as exc:
            error = exc
        try:
            c.raise_if_any(error)
        except Exception:
            self.storage.release()          # every rank is here: free the windows together
            raise
        self.exchange = self._build_exchange(compression, compression_options)
        # op="avg": each gradient scaled by 1/size as it becomes final, so the sum is the mean.
        # A compressor reduces in the calling thread (its collectives do not overlap), so
        # buckets would only add round trips: compressed gradients go as one after backward
        compressed = compression not in (None, "none")
        self.buckets = GradientBuckets(self.params, self.layout, self.storage, self.exchange, c,
                                       bucket_mb=0 if compressed else bucket_mb,
                                       passes_per_step=self.backward_passes_per_step,
                                       scale=1.0 / c.size if op == "avg" else 1.0,
                                       frozen=[(n, p) for n, p in named if not p.requires_grad])
        # the last step's figures: skipped, t_launch, t_wait, t_optim (seconds) and
        # launched_at (time.perf_counter() when each bucket's gradients were final)
        self.last_step: dict = {}
        self._by_bucket = None
        self._steps = 0                     # step() calls so far
        self.module_buffers = [b for _, b in model.named_buffers()] \
            if isinstance(model, torch.nn.Module) else []
        if broadcast:
            bcast_tensor(c, self.storage.tparams, 0)
            for t in self.frozen:
                bcast_tensor(c, t.data, 0)
            for b in self.module_buffers:
                bcast_tensor(c, b.data, 0)
            if not self.zero:                # ZeRO: each rank holds its own shard's state
                broadcast_optimizer_state(self.optimizer, 0, c)

    @property
    def param_groups(self):
        """torch's param_groups (a wrapped optimizer's own). Read after backward, they run
        synchronize() first (once per step; on some ranks only but for zero=2, as the
        others' step() matches it), so GradScaler.unscale_(opt) sees the average."""
        buckets = self.__dict__.get("buckets")
        if buckets is not None and buckets.backward_done:
            self.synchronize()
        return self._groups

    @param_groups.setter
    def param_groups(self, value):
        self._groups = value

    @property
    def flat_update(self) -> bool:
        """Whether an mpidist optimizer updates (param_groups are then this wrapper's own)."""
        return self._sync is not None

    @property
    def flat_params(self):
        """The flat parameter buffer (NumPy, or CuPy for a CUDA model; every trainable
        `param.data` is a view)."""
        return self.storage.params

    @property
    def flat_grads(self):
        """The flat gradient buffer (NumPy or CuPy; every `param.grad` is a view)."""
        return self.storage.grads

    # ------------------------------------------------------------------ set-up
    def _init_torch(self, groups) -> None:
        """torch.optim.Optimizer's own state: a wrapped torch optimizer's groups, state and
        defaults (the same objects), or groups over the mpidist optimizer (GroupSync)."""
        inner = self.optimizer
        if isinstance(inner, torch.optim.Optimizer):
            torch.optim.Optimizer.__init__(self, inner.param_groups, dict(inner.defaults))
            self._inner_torch = inner        # param_groups, state, defaults: inner's from now
            self._sync = None
            return
        defaults = fused_defaults(inner)
        dicts = group_dicts(self.params, groups)
        if len(dicts) > 1 and is_onebit(inner):
            raise ValueError(f"optimizer {inner.name!r} takes one param group")
        torch.optim.Optimizer.__init__(self, dicts, defaults)
        self._sync = GroupSync(self.params, inner)

    def add_param_group(self, param_group: dict) -> None:
        """Only while being built: the flat buffers hold the model's parameters then."""
        if getattr(self, "_sync", False) is not False:
            raise RuntimeError("a DistributedOptimizer's parameters are fixed when it is "
                               "built; pass every group then (param_groups=...)")
        super().add_param_group(param_group)

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

    def _build_exchange(self, compression, options):
        """Collective: the bucket exchange and update of this configuration."""
        c = self.comm
        if self.zero:
            exchange = Zero(self.storage, c, self.zero, algorithm=self.algorithm)
        else:
            compressed = None
            if compression not in (None, "none"):
                options = dict(options or {})
                warmup = options.pop("warmup_steps", 0)
                # nodes of several ranks: exact within each node, compressed between
                kind = NodeCompressedAllreduce if spans_nodes(c) else CompressedAllreduce
                compressed = kind(make_compressor(compression, **options), c,
                                  warmup_steps=warmup, nonfinite="skip")
            exchange = Allreduce(self.storage, c, algorithm=self.algorithm, compressed=compressed)
        if is_onebit(self.optimizer):
            # each rank's gradient is its share of the sum, or (scaled by 1/size in the
            # hooks) of the mean: size times it estimates the reduced gradient either way
            exchange = Onebit(exchange, self.optimizer, self.layout, c, mult=float(c.size))
        return exchange

    # ------------------------------------------------------------------ the step
    def synchronize(self) -> bool:
        """Launch what is left, agree on finiteness and wait for every bucket; returns
        whether the reduced gradients are finite on every rank (collective). Afterwards
        `.grad` holds the average (op="avg") or the sum, None where no rank had one (under
        zero=2 too: the reduced shards are gathered, which step() alone does not need)."""
        first = not self.buckets.synced
        finite = self.buckets.synchronize()
        if first:
            self.exchange.gather_grads()
        return finite

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate locally, as under DDP's no_sync(); the first
        backward after it reduces the sum of all of them."""
        if self.backward_passes_per_step != 1:
            raise RuntimeError("no_sync() and backward_passes_per_step > 1 are two spellings "
                               "of accumulation; use one")
        old, self.buckets.sync = self.buckets.sync, False
        try:
            yield
        finally:
            self.buckets.sync = old

    @contextlib.contextmanager
    def join(self):
        """Uneven inputs: a rank whose loop inside ends early shadows the others' steps
        until all have left theirs (mpidist.torch.join). Collective; data parallel only."""
        error = None
        if self.zero or isinstance(self.exchange, Onebit) or \
                self.exchange.compressed is not None:
            error = ValueError("join() is for data parallel training without compression or "
                               "1-bit optimizers (zero=0): elsewhere a joined rank's state "
                               "would be needed by the others' steps")
        elif self.buckets.in_flight:
            error = RuntimeError("join() entered between backward() and step()")
        self.comm.raise_if_any(error)
        start = self._steps                 # an error inside: the others wait for the watchdog
        yield self
        shadow_until_all_joined(self, self._steps - start)

    def step(self, closure=None):
        """Wait for the gradients, then update (skipped on every rank when any gradient is
        Inf/NaN). Returns the closure's loss, if a closure is given.

        1. launch what is left (parameters that got no gradient count as zero, as in DDP);
        2. agree on finiteness with one small allreduce of the flags found in the hooks (no
           pass over the gradients; in the shared window the sums are checked as they are
           made); 3. wait for the buckets; 4. update: the mpidist optimizer's fused kernel
        over the flat buffers with param_groups' values, or the wrapped torch optimizer on
        the `.grad` views; 5. settle: no rank reads my gradients any more (the window's
        fence, which ran during the update)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = time.perf_counter()
        each = self._bucketwise()
        spent = each.spent if each is not None else 0.0
        finite = self.buckets.synchronize(settle=False, each=each)
        t1 = time.perf_counter()
        update = finite and not self.buckets.joined
        info = {"skipped": not update}
        if update and each is None:
            if self._sync is not None:
                self._sync.apply(self.param_groups, self.buckets.unused)
            info.update(self.exchange.update(self.optimizer, 1.0))
        self.exchange.settle()
        t2 = time.perf_counter()
        overlapped = each.spent - spent if each is not None else 0.0    # updates in the wait
        self.last_step = {**info, "t_launch": self.buckets.t_launch,
                          "launched_at": self.buckets.launched_at,
                          "t_wait": t1 - t0 - overlapped, "t_optim": t2 - t1 + overlapped}
        self.buckets.new_round()
        self._steps += 1
        return loss

    def _bucketwise(self):
        """step()'s update of one bucket as it comes back, or None (bucketwise.usable)."""
        if self.buckets.synced or not isinstance(self.exchange, Allreduce) or \
                self.storage.device.type != "cpu" or \
                self.exchange.in_window() or not usable(self.optimizer, self.buckets.buckets):
            return None
        if self._by_bucket is None:
            self._by_bucket = BucketSteps(self.optimizer, self.params, self.layout,
                                          self.buckets.buckets)
        return self._by_bucket

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients. set_to_none: `.grad` becomes None until the next backward
        puts it back into the flat buffer (as torch's default); else the views are zeroed.
        After a backward whose step is skipped, the buckets it launched are waited for
        first (collective, as step() would be): the ranks still read this rank's buffer."""
        if self.buckets.in_flight:
            self.buckets.synchronize()
        if set_to_none:
            for p in self.params:
                p.grad = None
        else:
            self.storage.zero_grads()
        self.buckets.new_round()

    # ------------------------------------------------------------------ torch state
    def state_dict(self) -> dict:
        """What torch.save carries: the wrapped torch optimizer's own state dict, or the
        mpidist optimizer's state over the whole model (collective under ZeRO: gathered
        from the shards, so it loads at any rank count and ZeRO stage)."""
        if self._sync is None:
            return self.optimizer.state_dict()
        return fused_state_dict(self.optimizer, self.param_groups, self.comm, self.shard)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore state_dict()'s output (param_groups' values included)."""
        if self._sync is None:
            self.optimizer.load_state_dict(state_dict)
        else:
            load_fused_state(self.optimizer, self.param_groups, state_dict, self.shard)

    def close(self) -> None:
        """Collective: detach from the model's backward and free the shared windows (the
        gradients then live in a private copy; the parameters stay in a flat buffer)."""
        self.buckets.remove()
        self.storage.release()

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({len(self.params)} tensors, {self.layout.numel} "
                f"elements, {len(self.buckets.buckets)} buckets, ranks={self.comm.size}, "
                f"optimizer={type(self.optimizer).__name__})")
