"""The compressed allreduce: the average over ranks of each rank's compressed gradient,
with the exact number of bytes each rank sent (payloads, their length headers, padding).

Three ways, the compressor's aggregation by default: "gather" (every payload round the ring,
decompressed and summed in rank order on every rank), "ring" (encoded partial sums round
the ring: 2(p-1)/p of a payload at any p) and "linear" (coordinates that add up, summed by
a float32 ring). Every rank ends with the same bits. Before any data moves, one allgather
agrees on every rank's input checks, options and inf/NaN flags: a bad input raises on every
rank, and inf/NaN raises everywhere or skips the step everywhere (nonfinite="skip"), so a
NaN never reaches an error-feedback residual. See docs/ARCHITECTURE.md (compression).
"""
from __future__ import annotations

import copy

import numpy as np

from mpidist.collectives.arrays import accept_arrays
from mpidist.collectives.handle import Handle
from mpidist.comm import as_communicator
from mpidist.compress.base import Compressor, kernels_for
from mpidist.compress.buckets import bucket_key, bucket_layout
from mpidist.compress.codecs import CompressorCodec, RawCodec
from mpidist.compress.reduce_scatter import reduce_scatter
from mpidist.compress.ring import Ring
from mpidist.compress.wire import pack, unpack
from mpidist.errors import MismatchError, agree_or_raise
from mpidist.kernels.backend import get_array_module, to_numpy
from mpidist.partition import chunk

__all__ = ["CompressedAllreduce"]

_ALGORITHMS = ("auto", "gather", "ring", "linear")
_NONFINITE = ("raise", "skip")


class CompressedAllreduce:
    """avg = ca(grad_flat, layout): the compressed average over the ranks of `comm`.

    compressor: a Compressor (make_compressor(name, ...)). Its residual is this rank's and
      belongs to one buffer: calls on other buffers (e.g. the buckets of one flat gradient,
      told apart by bucket_key) get their own copy of the compressor, made on first use.
      `ca.compressor` is the first buffer's.
    algorithm: "auto" (the compressor's own aggregation), "gather", "ring" (any compressor
      that gathers may instead ring its re-encoded partial sums: 2(p-1)/p payloads sent
      instead of p-1; with error feedback nothing is lost, but the result is no longer
      exactly the sum of each rank's decompressed payload), "linear".
    warmup_steps: each buffer's first calls run a plain ring allreduce, in float32 (or as
      the compressor's sums cross: PowerSGD's float16 factors make it a float16 ring).
    nonfinite: "raise" or "skip" when any rank's gradient holds inf/NaN.
    After a call: bytes_sent (that call), total_bytes_sent, step (calls), skipped_steps,
    last_skipped.
    """

    def __init__(self, compressor: Compressor, comm=None, *, algorithm: str = "auto",
                 warmup_steps: int = 0, nonfinite: str = "raise"):
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a Compressor (make_compressor(name, ...)), "
                            f"got {type(compressor).__name__}")
        if algorithm not in _ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(_ALGORITHMS)}, "
                             f"got {algorithm!r}")
        algorithm = compressor.aggregation if algorithm == "auto" else algorithm
        compressor.check_algorithm(algorithm)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, np.integer)) \
                or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be one of {', '.join(_NONFINITE)}, "
                             f"got {nonfinite!r}")
        self.comm = as_communicator(comm)
        self.compressor = compressor
        self._pristine = copy.deepcopy(compressor)
        self._buffers: dict = {}        # bucket_key -> [compressor, calls]
        self.algorithm = algorithm
        self.warmup_steps = int(warmup_steps)
        self.nonfinite = nonfinite
        self.step = 0
        self.bytes_sent = 0
        self.total_bytes_sent = 0
        self.skipped_steps = 0
        self.last_skipped = False

    def __repr__(self) -> str:
        return (f"CompressedAllreduce({self.compressor!r}, algorithm={self.algorithm!r}, "
                f"warmup_steps={self.warmup_steps}, ranks={self.comm.size})")

    def _buffer(self, key):
        """[compressor, calls] of one buffer; the first buffer uses `self.compressor`."""
        state = self._buffers.get(key)
        if state is None:
            c = self.compressor if not self._buffers else copy.deepcopy(self._pristine)
            c.stream = self.comm.rank          # independent randomness per rank
            state = self._buffers[key] = [c, 0]
        return state

    # ---------------------------------------------------------------- agreement
    def _agree(self, grad, layout, err=None, extra=None) -> bool:
        """Collective: raise on every rank for any rank's bad input (err: one found before)
        or a mismatch; return whether any rank's gradient holds inf/NaN."""
        sig, bad = None, False
        try:
            if err is not None:
                raise err
            if not hasattr(grad, "ndim") or grad.ndim != 1:
                raise ValueError(f"the gradient must be a 1-D flat array, got "
                                 f"{getattr(grad, 'shape', type(grad).__name__)}")
            if grad.dtype.kind != "f":
                raise TypeError(f"the gradient must be floating point, got {grad.dtype}")
            if layout is not None and layout.numel != grad.shape[0]:
                raise ValueError(f"layout has {layout.numel} elements, gradient "
                                 f"{grad.shape[0]}")
            sig = (self.compressor.config(), self.algorithm, self.warmup_steps,
                   int(grad.shape[0]), str(grad.dtype), self.step,
                   None if layout is None else [(s.name, s.shape) for s in layout], extra)
            work = get_array_module(grad).ascontiguousarray(grad, dtype=np.float32)
            bad = not bool(kernels_for(work).all_finite(work.view(np.uint32)))
        except (TypeError, ValueError) as exc:
            err = exc
        views = agree_or_raise(self.comm, err, share=(sig, bad))
        sigs = [s for s, _ in views]
        if any(s != sigs[0] for s in sigs):
            differ = [r for r, s in enumerate(sigs) if s != sigs[self.comm.rank]]
            raise MismatchError(f"compressed allreduce: ranks {differ} differ from rank "
                                f"{self.comm.rank} in (compressor options, algorithm, "
                                f"warm-up, length, dtype, call number, layout, range): "
                                f"{sigs[self.comm.rank]} vs {sigs[differ[0]]}")
        nonfinite = [r for r, (_, b) in enumerate(views) if b]
        if nonfinite and self.nonfinite == "raise":
            raise FloatingPointError(f"gradient holds inf/NaN on rank(s) {nonfinite}; nothing "
                                     f"was sent and residuals are unchanged (use "
                                     f"nonfinite='skip' with dynamic loss scaling)")
        return bool(nonfinite)

    # ---------------------------------------------------------------- the call
    @accept_arrays("grad", out=None)
    def __call__(self, grad, layout=None):
        """The average over ranks of the compressed gradients (same shape and dtype)."""
        return self._reduce(grad, layout, "avg")

    @accept_arrays("buf", out=None)
    def allreduce_async(self, buf, *, op: str = "sum", layout=None,
                        inplace: bool = False) -> Handle:
        """The engine's bucket interface: the sum (op="sum") or average ("avg") of one
        bucket. It runs now (compression does not overlap); wait() returns the result.

        layout: the layout of the bucket, or of the whole flat buffer the bucket views
        (then the bucket's own segments are taken: PowerSGD needs them to see matrices).
        inplace: the result is written into buf (a writable NumPy or CuPy array), which
        wait() returns; PowerSGD then decompresses straight into it.
        """
        if op not in ("sum", "avg"):
            raise ValueError(f"compressed allreduce supports op 'sum' or 'avg', got {op!r}")
        err = None
        if layout is not None and getattr(buf, "ndim", 0) == 1 and layout.numel != buf.shape[0]:
            layout, err = bucket_layout(layout, buf)
        return Handle(self._reduce(buf, layout, op, err, inplace))

    def _reduce(self, grad, layout, op, err=None, inplace=False):
        skip = self._agree(grad, layout, err)
        xp = get_array_module(grad)
        ring = Ring(self.comm)
        self.last_skipped = skip
        if skip:
            self.skipped_steps += 1
            out = xp.full(grad.shape, np.nan, dtype=np.float32)
        else:
            state = self._buffer(bucket_key(grad))
            work = xp.ascontiguousarray(grad, dtype=np.float32)
            if state[1] < self.warmup_steps:
                # warm-up: the plain ring, in float32 (or the compressor's sum_codec)
                out = xp.asarray(ring.allreduce(to_numpy(work).copy(),
                                                state[0].sum_codec or RawCodec))
            elif self.algorithm == "gather":
                out = self._gather(ring, state[0], work, layout)
            elif self.algorithm == "ring":
                out = self._ring(ring, state[0], work)
            else:
                into = grad if inplace and work is grad else None
                out = self._linear(ring, state[0], work, layout, into)
            state[1] += 1
            if op == "avg":
                out /= self.comm.size
        self.step += 1
        self.bytes_sent = ring.sent
        self.total_bytes_sent += ring.sent
        if inplace:
            if out is not grad:
                grad[...] = out
            return grad
        return out.astype(grad.dtype, copy=False)

    @accept_arrays("buf", out=None)
    def reduce_scatter(self, buf, *, lo: int = 0, n: int | None = None):
        """My piece of the compressed sum over ranks (ZeRO stages 2 and 3).

        buf: the global range [lo, lo + len(buf)) of an n-element flat gradient (n: default
        lo + len(buf)) whose shards are chunk(n, rank, size). Returns that range ∩ my chunk
        as float32: the sum over ranks of each rank's decompressed piece
        (mpidist.compress.reduce_scatter). Each range (lo, len(buf)) has its own compressor
        and residual; warm-up, inf/NaN handling and byte counts as for the allreduce.
        """
        err = None
        m = int(buf.shape[0]) if getattr(buf, "ndim", 0) == 1 else 0
        if n is None and isinstance(lo, (int, np.integer)):
            n = lo + m
        if not self.compressor.decodes_alone:
            err = ValueError(f"compressor {self.compressor.name!r} cannot reduce-scatter: its "
                             f"payloads only decode once summed over all ranks (use an "
                             f"allreduce, e.g. ZeRO stage 1)")
        elif isinstance(lo, bool) or not isinstance(lo, (int, np.integer)) or \
                isinstance(n, bool) or not isinstance(n, (int, np.integer)) or \
                not 0 <= lo <= lo + m <= n:
            err = ValueError(f"reduce_scatter needs 0 <= lo <= lo + len(buf) <= n, got "
                             f"lo={lo!r}, len(buf)={m}, n={n!r}")
        skip = self._agree(buf, None, err, extra=(int(lo), int(n)))
        xp = get_array_module(buf)
        offset, count = chunk(n, self.comm.rank, self.comm.size)
        mine = max(0, min(lo + m, offset + count) - max(lo, offset))
        sent = 0
        self.last_skipped = skip
        if skip:
            self.skipped_steps += 1
            out = xp.full(mine, np.nan, dtype=np.float32)
        else:
            state = self._buffer((int(lo), m))
            work = xp.ascontiguousarray(buf, dtype=np.float32)
            raw = state[1] < self.warmup_steps           # warm-up: float32 pieces
            out, sent = reduce_scatter(self.comm, None if raw else state[0], work, lo, n)
            state[1] += 1
        self.step += 1
        self.bytes_sent = sent
        self.total_bytes_sent += sent
        return out

    def _gather(self, ring: Ring, c: Compressor, x, layout):
        """Allgather every rank's payload; decompress and sum them in rank order."""
        payload, ctx = c.compress(x, layout)
        dtypes = [a.dtype for a in payload]
        xp = get_array_module(x)
        out = xp.zeros(x.shape[0], dtype=np.float32)
        for msg in ring.allgather(pack(payload)):
            c.decode_add(tuple(xp.asarray(a) for a in unpack(msg, dtypes)), ctx, out)
        return out

    def _ring(self, ring: Ring, c: Compressor, x):
        """Ring reduce-scatter and allgather on encoded chunks, re-encoding partial sums.

        With error feedback every encoding's loss (data - decode(message)) is kept by the
        rank that encoded, at those positions: summed over ranks, residuals plus the result
        equal the sum of the inputs, as with a gather."""
        host = np.array(to_numpy(c.with_residual(x, None)), dtype=np.float32)
        err = np.zeros_like(host) if c.error_feedback else None
        ring.allreduce(host, CompressorCodec(c, err))
        xp = get_array_module(x)
        if err is not None:
            c.residual = xp.asarray(err)
        c.step += 1
        return xp.asarray(host)

    def _linear(self, ring: Ring, c: Compressor, x, layout, into=None):
        """The compressor's own reduce, its sums done by the ring (float32, or the
        compressor's sum_codec; the result written into `into` where given)."""
        xp = get_array_module(x)
        codec = c.sum_codec or RawCodec

        def allreduce_sum(a):
            return xp.asarray(ring.allreduce(to_numpy(a).astype(np.float32, copy=True),
                                             codec))

        return c.reduce(x, layout, allreduce_sum, ranks=self.comm.size, into=into)

    # ---------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        """This rank's state (residuals are per rank: save one per rank), per buffer."""
        return {"step": self.step, "skipped_steps": self.skipped_steps,
                "total_bytes_sent": self.total_bytes_sent,
                "buffers": [[list(key), calls, c.state_dict()]
                            for key, (c, calls) in self._buffers.items()]}

    def load_state_dict(self, sd: dict) -> None:
        self._buffers = {}
        for key, calls, csd in sd["buffers"]:
            state = self._buffer(tuple(key))
            state[0].load_state_dict(csd)
            state[1] = int(calls)
        self.step = int(sd["step"])
        self.skipped_steps = int(sd["skipped_steps"])
        self.total_bytes_sent = int(sd["total_bytes_sent"])
