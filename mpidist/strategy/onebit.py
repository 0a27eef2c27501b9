"""The compression stage of the 1-bit optimizers (mpidist.optim.onebit) in a data-parallel
group: what dp, ZeRO and the pipeline's data-parallel groups share.

During the warm-up gradients are averaged as usual. Once the optimizer is frozen no
gradient is sent; per step (OnebitDriver):
    1. local momentum  m_i = b1*m + (1-b1)*mult*g_i over the range this rank holds
    2. worker side     compressed reduce-scatter of m_i onto the chunk owners (worker error feedback)
    3. server side     each owner averages and compresses its chunk (server error feedback);
                       every rank gathers the average whole (mpidist.compress.momentum: 2, 3)
    4. the update      the optimizer's step on its range of that average
Checkpoints hold the worker residuals (strategy.compression_state's rule), the server
residuals (compress/server_residual/<tensor>) and the counters; the phase is the
optimizer's step count, so a resume does not restart the warm-up.
"""
from __future__ import annotations

import numpy as np

from mpidist.compress import MomentumAllreduce, make_compressor
from mpidist.compress.momentum import allgather_shards, check_momentum_compressor
from mpidist.kernels.backend import get_array_module
from mpidist.optim.base import StepInfo
from mpidist.state import flat_pieces, read_flat
from mpidist.strategy.compression_state import compression_pieces, compression_scalars, restore_compression

__all__ = ["OnebitDriver", "SERVER_RESIDUAL", "is_onebit", "config_errors"]

SERVER_RESIDUAL = "compress/server_residual"


def is_onebit(optimizer) -> bool:
    """Whether the optimizer is one of the 1-bit ones (its engine must drive the exchange)."""
    return bool(getattr(optimizer, "onebit", False))


class OnebitDriver:
    """The momentum exchange of one 1-bit optimizer over a data-parallel group.

    optimizer: OnebitAdam / OnebitLAMB over [offset, offset+count) of layout; comm: the
    ranks whose gradients are averaged (collective construction); mult: what this rank's
    gradient is multiplied by to estimate the average (size when gradients are summed).
    """

    def __init__(self, optimizer, layout, comm, *, mult: float, xp=np):
        self.opt, self.layout, self.comm, self.mult = optimizer, layout, comm, float(mult)
        error, ex = None, None
        try:
            compressor = make_compressor(optimizer.compressor, **optimizer.compressor_options)
            ex = MomentumAllreduce(compressor, layout.numel, comm, xp=xp)
        except (TypeError, ValueError) as exc:
            error = ValueError(f"[optim] {optimizer.name} compressor "
                               f"{optimizer.compressor!r}: {exc}")
        comm.raise_if_any(error)
        self.ex = ex
        self.den = None         # the frozen denominator, whole (set by begin)
        self.summed = None      # my chunk of the compressed sum over ranks (this step)

    @property
    def frozen(self) -> bool:
        return self.opt.frozen

    @property
    def bytes_sent(self) -> int:
        return self.ex.bytes_sent

    def begin(self) -> None:
        """Before a step's local momenta: the whole averaged momentum and the frozen
        denominator on this rank (gathered from the optimizers' exp_avg and exp_avg_sq
        after the warm-up or a load), and a zero sum for my chunk."""
        if not self.ex.ready:
            states = self.opt.state_buffers()
            self.ex.gather(states["exp_avg"], self.opt.offset)
            v = allgather_shards(self.comm, states["exp_avg_sq"], self.opt.offset,
                                 self.layout.numel)
            self.den = self.opt.frozen_denominator(v)
        xp = get_array_module(self.ex.momentum)
        if self.summed is None or get_array_module(self.summed) is not xp:
            self.summed = xp.zeros(self.ex.count, np.float32)
        self.summed[...] = 0

    def send(self, g, lo: int = 0) -> None:
        """1.-2. g: this rank's gradient over [lo, lo+len(g)) (float32; overwritten with its
        momentum in the frozen denominator's scale); my chunk's part of the compressed sum
        over ranks is added into `summed` (NaN if any rank's g was not finite)."""
        hi = lo + g.shape[0]
        self.opt.local_momentum(self.ex.momentum[lo:hi], g, self.den[lo:hi], self.mult)
        part = self.ex.reduce_scatter(g, lo)
        start = max(lo, self.ex.offset) - self.ex.offset
        self.summed[start:start + part.shape[0]] += part

    def finish(self, params, reduce_norms=None, finite: bool | None = None) -> StepInfo:
        """3.-4. After every range was sent: params (the optimizer's range) updated from the
        average. finite: whether `summed` is finite on every rank, if the caller agreed it
        already (else one small allreduce here); if not, the step is skipped on every rank
        and nothing changes."""
        if finite is None:
            bad = 0.0 if bool(get_array_module(self.summed).isfinite(self.summed).all()) else 1.0
            finite = self.comm.comm.allreduce(bad) == 0
        if not finite:
            return StepInfo(True, "non-finite gradients", self.opt.step_count, self.opt.lr)
        m = self.ex.allgather(self.summed, self.den)
        lo = self.opt.offset
        return self.opt.step(params, m[lo:lo + self.opt.count], reduce_norms, finite=True)

    def step(self, params, grads, reduce_norms=None, finite: bool | None = None) -> StepInfo:
        """1.-4. with this rank's whole gradient buffer (dp, ZeRO stage 1; float32, which
        is overwritten). finite: as for finish (of the gradients)."""
        self.begin()
        if finite is False:
            return StepInfo(True, "non-finite gradients", self.opt.step_count, self.opt.lr)
        self.send(grads, 0)
        return self.finish(params, reduce_norms, finite)

    # ---------------------------------------------------------------- checkpoints
    def pieces(self, replica: int, replicas: int) -> dict:
        """This rank's pieces of the exchange's state (keys in the module docstring)."""
        out = compression_pieces(self.ex.worker, self.layout, replica, replicas)
        res = self.ex.server.residual
        if res is not None:
            out.update(flat_pieces(SERVER_RESIDUAL, self.layout, res, self.ex.offset))
        return out

    def scalars(self) -> dict:
        return {"compression": compression_scalars(self.ex.worker),
                "onebit": {"server_step": self.ex.server.step,
                           "server_config": self.ex.server.config()}}

    def restore(self, source, buckets, replica: int, replicas: int) -> None:
        """Load the exchange's state for the worker ranges `buckets` ([(offset, count)]):
        worker residuals by strategy.compression_state's rule, my chunk of the server residual
        (any writer world size), counters; zeros where the checkpoint has none."""
        ex = self.ex
        restore_compression(ex.worker, source, self.layout, buckets, replica, replicas)
        saved = source.scalars.get("onebit") or {}
        keys = set(source.keys())
        residual = None
        if ex.count and all(f"{SERVER_RESIDUAL}/{self.layout.segments[i].name}" in keys
                            for i, _, _ in self.layout.clip(ex.offset, ex.offset + ex.count)):
            residual = np.zeros(ex.count, np.float32)
            read_flat(source, SERVER_RESIDUAL, self.layout, residual, ex.offset)
        same = saved.get("server_config") == ex.server.config()
        sd = {"config": ex.server.config(), "step": int(saved.get("server_step", 0)) if same else 0,
              "residual": residual}
        ex.server.load_state_dict(sd)
        ex.ready = False


def config_errors(cfg: dict, opt) -> list[str]:
    """What a job config asks of a 1-bit optimizer that cannot be done, as messages (none
    for another optimizer): its compressor and options, gradient compression beside it,
    strategies without data-parallel gradient averaging, accumulation in ZeRO stages 2, 3.
    opt: the config's optimizer, built on any layout."""
    o, p = cfg["optim"], cfg["parallel"]
    if not is_onebit(opt):
        return []
    errors, where = [], f"[optim] name = {o['name']!r}"
    try:
        check_momentum_compressor(make_compressor(opt.compressor, **opt.compressor_options))
    except (TypeError, ValueError) as exc:
        errors.append(f"{where}: hyper.compressor = {opt.compressor!r}: {exc}")
    if p["compression"] != "none":
        errors.append(f"{where} compresses its own momentum after freeze_step; remove [parallel] "
                      f"compression = {p['compression']!r}")
    if p["strategy"] in ("ps", "admm"):
        errors.append(f"{where} needs data-parallel gradient averaging (strategy dp, zero or "
                      f"pipeline), not {p['strategy']!r}")
    if p["strategy"] == "zero" and p["stage"] > 1 and p["accumulation"] > 1:
        errors.append(f"{where} with zero stage {p['stage']} sends each micro-batch's buckets; "
                      f"the local momentum needs the whole step's gradient: use accumulation = 1 "
                      f"or stage 1")
    return errors

