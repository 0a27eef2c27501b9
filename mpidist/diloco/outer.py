"""The outer step of DiLoCo and local SGD: theta_outer, its optimizer, and the exchange of
outer gradients between groups.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1): every group runs H inner
steps from theta_outer; then
    1. outer gradient: delta_g = theta_outer - theta_g, weighted by the group's share
       w_g = n_g / N of the samples the round trained on (1/G when groups see equal data);
    2. across groups: sum_g w_g * delta_g, an allreduce among one rank per group (the
       leaders), in float32 or compressed (fp16, bf16, sign with error feedback, ...;
       OpenDiLoCo found an fp16 exchange lossless);
    3. within each group: the leader broadcasts the sum;
    4. outer step: theta_outer <- OuterOpt(theta_outer, sum), Nesterov SGD by default
       (outer lr 0.7, momentum 0.9); every rank restarts its inner steps from theta_outer.
Streaming DiLoCo (mpidist.diloco.streaming) runs these steps on one fragment of the
buffer at a time, each fragment with its own outer optimizer over its range.
Local SGD (Stich 2019) is the special case outer lr 1, no momentum: plain averaging of the
groups' parameters. Weighting by samples keeps groups of unequal size unbiased and makes
H = 1 with outer lr 1 exactly the data-parallel step of inner SGD.
Every rank of every group ends a sync with the same bits: the same inputs reach the same
optimizer on every rank.
"""
from __future__ import annotations

import time

from mpidist.collectives import allreduce
from mpidist.compress import CompressedAllreduce, make_compressor
from mpidist.diloco.groups import Groups
from mpidist.diloco.streaming import fragment_spans
from mpidist.kernels.backend import get_array_module
from mpidist.optim import build_optimizer

__all__ = ["OuterOptimizer"]


class OuterOptimizer:
    """theta_outer over one flat parameter buffer, and the outer step of every sync.

    params: this rank's flat parameter buffer (the inner model's, updated in place by
      sync()); layout: its mpidist.flat.Layout; groups: mpidist.diloco.make_groups(...).
    lr, momentum, nesterov: the outer SGD (momentum 0: plain SGD; nesterov applies when
      momentum > 0).
    compression: "none" or a compressor name of mpidist.compress (fp16, bf16, sign, ...)
      for the leaders' allreduce; compression_options: its options.
    algorithm: the float32 allreduce among the leaders (mpidist.collectives).
    fragments: streaming DiLoCo's fragments of whole tensors (spans, an outer optimizer each;
      1 = the whole buffer).
    Construction is collective over groups.world: every group starts from world rank 0's
    parameters.
    """

    def __init__(self, params, layout, groups: Groups, *, lr: float = 0.7, momentum: float = 0.9,
                 nesterov: bool = True, compression: str = "none", compression_options=None,
                 algorithm: str = "auto", fragments: int = 1):
        if getattr(params, "ndim", 0) != 1 or params.shape[0] != layout.numel:
            raise ValueError(f"params must be a 1-D buffer of the layout's {layout.numel} elements, "
                             f"got shape {getattr(params, 'shape', None)}")
        self.groups, self.layout, self.algorithm = groups, layout, algorithm
        world = groups.world
        buf = world.to_mpi(params)
        world.comm.Bcast(buf, root=0)
        world.from_mpi(buf, params)
        self.theta = params.copy()
        self.delta = get_array_module(params).zeros_like(params)
        self.spans = fragment_spans(layout, fragments)
        self.optimizers = [build_optimizer("sgd", layout, lr=lr, momentum=momentum, offset=lo, count=hi - lo,
                                           nesterov=bool(nesterov and momentum > 0)) for lo, hi in self.spans]
        self.compressed = None
        if compression != "none" and groups.is_leader:
            self.compressed = CompressedAllreduce(make_compressor(compression, **(compression_options or {})),
                                                  groups.leaders, nonfinite="skip")
        self.steps = 0                  # outer steps taken
        self.bytes_sent = 0             # this rank's outer-exchange bytes, all syncs (leaders)

    def sync(self, params, weight: float, fragments=None, done=None) -> dict:
        """Collective over groups.world: one outer step of each of `fragments` (indices into
        spans; None: all). params holds this group's theta_inner on entry and the new
        theta_outer over those fragments on return; weight is w_g, this group's share of
        the round's samples (the weights of all groups sum to 1), or an array of one per
        fragment (each fragment's round). done(f), if given, is called as each fragment's
        step is taken (a caller's bookkeeping then follows it if a later exchange fails).
        Returns {"skipped": an outer step was skipped (a non-finite outer gradient),
        "bytes": what this rank sent between groups (compressed: counted exactly; float32:
        a ring's 2(G-1)/G of the buffer), "t_comm", "t_optim"}."""
        out = {"skipped": False, "bytes": 0, "t_comm": 0.0, "t_optim": 0.0}
        for f in range(len(self.spans)) if fragments is None else fragments:
            info = self._sync_span(params, float(weight[f] if getattr(weight, "ndim", 0) else weight), f)
            if done is not None:
                done(f)
            out["skipped"] |= info["skipped"]
            for key in ("bytes", "t_comm", "t_optim"):
                out[key] += info[key]
        self.steps += 1
        self.bytes_sent += out["bytes"]
        return out

    def _sync_span(self, params, weight: float, fragment: int) -> dict:
        g = self.groups
        lo, hi = self.spans[fragment]
        theta, delta, mine = self.theta[lo:hi], self.delta[lo:hi], params[lo:hi]
        xp = get_array_module(params)
        t0 = time.perf_counter()
        # 1. outer gradient, weighted by the group's share of the samples
        xp.subtract(theta, mine, out=delta)
        delta *= weight
        # 2. across groups: the leaders sum their groups' outer gradients
        sent = 0
        if g.is_leader and g.count > 1:
            if self.compressed is not None:
                delta[...] = self.compressed.allreduce_async(delta, op="sum", layout=self.layout).wait()
                sent = self.compressed.bytes_sent
            else:
                allreduce(delta, op="sum", algorithm=self.algorithm, comm=g.leaders)
                sent = 2 * (g.count - 1) * int(delta.nbytes) // g.count   # a ring's share
        # 3. within the group: the leader's sum to every rank
        if g.group.size > 1:
            buf = g.group.to_mpi(delta)
            g.group.comm.Bcast(buf, root=0)
            g.group.from_mpi(buf, delta)
        t1 = time.perf_counter()
        # 4. the outer step (skipped everywhere alike on a non-finite sum); restart from it
        info = self.optimizers[fragment].step(theta, delta)
        mine[...] = theta
        return {"skipped": info.skipped, "bytes": sent, "t_comm": t1 - t0,
                "t_optim": time.perf_counter() - t1}

    # ------------------------------------------------------------------ state
    @property
    def step_counts(self) -> list[int]:
        """Outer optimizer steps taken, per fragment."""
        return [o.step_count for o in self.optimizers]

    @step_counts.setter
    def step_counts(self, counts) -> None:
        counts = list(counts) if isinstance(counts, (list, tuple)) else [int(counts)] * len(self.optimizers)
        for o, c in zip(self.optimizers, counts, strict=True):
            o.step_count = int(c)

    def state_buffers(self) -> dict:
        """{state name: the outer optimizer's state over the whole buffer} (a copy)."""
        xp = get_array_module(self.theta)
        names = self.optimizers[0].state_buffers()
        return {name: xp.concatenate([o.state_buffers()[name] for o in self.optimizers]) for name in names}

    def load_state_buffers(self, buffers: dict) -> None:
        """Restore state_buffers()'s arrays (whole-buffer, by name) into every fragment."""
        for o, (lo, hi) in zip(self.optimizers, self.spans):
            for name, buf in o.state_buffers().items():
                buf[...] = buffers[name][lo:hi]
