"""The compressor interface and its error-feedback state.

A compressor turns a flat float32 gradient into a payload (a tuple of arrays, the bytes
that travel) and a context (what every rank can rebuild from the gradient's length and
the step alone: nothing rank-dependent). Stateful compressors keep, per rank:
- the error-feedback residual e: compress(x) encodes x + e and keeps e <- (x + e) - C(x + e),
  so what was dropped is sent later (Seide et al. 1-bit SGD; Karimireddy et al. EF-signSGD);
- a step counter, which seeds per-step randomness;
- compressor-specific state (PowerSGD's warm-start Q).
state_dict / load_state_dict checkpoint all of it.

`aggregation` tells the compressed allreduce how payloads combine by default: "gather"
(each rank decompresses every payload), "ring" (encoded partial sums) or "linear"
(coordinates that add up, through a plain sum-allreduce: `reduce`).
"""
from __future__ import annotations

import math

import numpy as np

from mpidist.kernels.backend import get_array_module, to_numpy
from mpidist.kernels.dispatch import kernels_for

__all__ = ["Compressor", "step_seed", "check_ratio", "kept_count", "check_multiple_of_8", "kernels_for"]


def step_seed(*words: int) -> int:
    """A well-mixed 32-bit seed from integers (seed, stream, step), equal on every machine."""
    return int(np.random.SeedSequence([int(w) & 0xFFFFFFFF for w in words]).generate_state(1)[0])


def check_ratio(ratio) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating, np.integer)):
        raise TypeError(f"ratio must be a number in (0, 1], got {type(ratio).__name__}")
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1] (the kept fraction, e.g. 0.01), got {ratio}")
    return ratio


def kept_count(ratio: float, n: int) -> int:
    """How many of n elements a sparsifier keeps at this ratio: at least one, at most n."""
    return 0 if n == 0 else min(n, max(1, math.ceil(ratio * n)))


def check_multiple_of_8(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < 8 or value % 8:
        raise ValueError(f"{what} must be a positive multiple of 8 (bytes never straddle "
                         f"chunks), got {value}")
    return int(value)


class Compressor:
    """Base class: compress(x) -> (payload, ctx), decompress(payload, ctx) -> x.

    Subclasses implement `encode(x, layout) -> (payload, ctx)` and
    `decode_add(payload, ctx, out)` (out += decompressed), and may override `residual_of`
    with something cheaper than x - decompress(...).
    """
    name = ""
    aggregation = "gather"
    decodes_alone = True     # each payload decompresses by itself (PowerSGD's do not)
    sum_codec = None         # linear: how the ring carries the sums (None: float32 as is)

    def __init__(self, *, error_feedback: bool, seed: int = 0):
        if not isinstance(error_feedback, (bool, np.bool_)):
            raise TypeError(f"error_feedback must be a bool, got {type(error_feedback).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.error_feedback = bool(error_feedback)
        self.seed = int(seed)
        self.stream = 0        # set to the rank by the compressed allreduce (independent noise)
        self.step = 0
        self.residual = None

    # ---------------------------------------------------------------- identity
    def config(self) -> dict:
        """Everything that must be equal on all ranks (checked by the compressed allreduce)."""
        return {"name": self.name, "error_feedback": self.error_feedback, "seed": self.seed}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"

    # ---------------------------------------------------------------- the interface
    def compress(self, x, layout=None):
        """(payload, ctx) of x (plus the residual, with error feedback)."""
        if self.error_feedback and self.fuses_feedback:
            x = self._check(x, layout)
            return self._compress_fused(x, [(0, x.shape[0])], layout)[0]
        x = self.with_residual(x, layout)
        payload, ctx = self.encode(x, layout)
        self._end(x, payload, ctx)
        return payload, ctx

    def decompress(self, payload, ctx, out=None):
        """The dense float32 vector a payload stands for (added into `out` if given)."""
        if out is None:
            xp = get_array_module(*payload)
            out = xp.zeros(ctx["n"], dtype=np.float32)
        self.decode_add(payload, ctx, out)
        return out

    def context(self, n: int) -> dict:
        """The ctx this call's encode would give an n-element input, rebuilt without the
        data (every rank can decode a payload another rank encoded at the same step)."""
        return {"n": int(n)}

    def encode(self, x, layout):
        raise NotImplementedError

    # a compressor whose encode_feedback does with_residual, encode and residual_of in one
    # pass sets this (the same results, without the whole-buffer temporaries)
    fuses_feedback = False

    def encode_feedback(self, x, residual, layout):
        """(payload, ctx) of x + residual; residual <- (x + residual) - decompress(payload).
        Called only where fuses_feedback is set; other compressors do the steps apart."""
        raise NotImplementedError

    def decode_add(self, payload, ctx, out) -> None:
        raise NotImplementedError

    def residual_of(self, x, payload, ctx):
        """What compression dropped: x - decompress(payload)."""
        r = x.copy()
        r -= self.decompress(payload, ctx)
        return r

    def check_algorithm(self, algorithm: str) -> None:
        """ValueError unless the compressed allreduce may combine payloads by `algorithm`:
        the compressor's own aggregation, or ring <-> gather (re-encoded partial sums)."""
        agg = self.aggregation
        if algorithm != agg and {algorithm, agg} != {"gather", "ring"}:
            raise ValueError(f"compressor {self.name!r} aggregates by {agg!r}; "
                             f"algorithm {algorithm!r} does not apply (use 'auto')")

    @staticmethod
    def payload_nbytes(payload) -> int:
        return int(sum(a.nbytes for a in payload))

    # ---------------------------------------------------------------- error feedback
    def with_residual(self, x, layout):
        """What to encode: x, validated, plus the residual with error feedback (a new
        array: x itself is never modified). For callers that encode x themselves, such as
        the compressed ring."""
        return self._accumulate(self._check(x, layout))

    def _check(self, x, layout):
        """x as a contiguous 1-D float32 finite gradient, or an error saying what is wrong."""
        xp = get_array_module(x)
        if not hasattr(x, "ndim") or x.ndim != 1:
            raise ValueError(f"{self.name}: compress takes a 1-D (flat) gradient, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        if x.dtype != np.float32:
            raise TypeError(f"{self.name}: compress takes float32, got {x.dtype}; cast first "
                            f"(the compressed allreduce does this for you)")
        if layout is not None and layout.numel != x.shape[0]:
            raise ValueError(f"{self.name}: layout has {layout.numel} elements, gradient "
                             f"{x.shape[0]}")
        x = xp.ascontiguousarray(x)
        if not bool(kernels_for(x).all_finite(x.view(np.uint32))):
            raise ValueError(f"{self.name}: the gradient holds inf or NaN; nothing was "
                             f"compressed and the residual is unchanged (skip this step or "
                             f"lower the loss scale)")
        return x

    def _accumulate(self, x):
        """x + e with error feedback (e: the residual, made on first use), else x."""
        if not self.error_feedback:
            return x
        self.residual = self._state_like(self.residual, x)
        return x + self.residual

    def _state_like(self, state, x):
        """A per-element state array for gradients like x: zeros on first use, moved to
        x's device after a host checkpoint load; an error if the length changed."""
        xp = get_array_module(x)
        if state is None or state.shape != x.shape:
            if state is not None and self.step:
                raise ValueError(f"{self.name}: gradient length changed from "
                                 f"{state.shape[0]} to {x.shape[0]}; one compressor "
                                 f"serves one flat buffer (make one per buffer)")
            return xp.zeros_like(x)
        if get_array_module(state) is not xp:
            return xp.asarray(state)      # loaded from a host checkpoint
        return state

    def compress_pieces(self, x, pieces):
        """[(payload, ctx)] of each piece (start, count) of x (plus the residual), encoded on
        its own: one call (one step) whose residual keeps, piece by piece, what that piece's
        encoding dropped. The pieces tile x in order (the compressed reduce-scatter's one
        piece per owner, empty ones included)."""
        ends = [0]
        for start, count in pieces:
            ends.append(start + count if start == ends[-1] and count >= 0 else -1)
        if ends[-1] != x.shape[0]:
            raise ValueError(f"{self.name}: pieces {pieces} do not tile {x.shape[0]} elements")
        if self.error_feedback and self.fuses_feedback:
            return self._compress_fused(self._check(x, None), pieces, None)
        x = self.with_residual(x, None)
        parts = [(start,) + self.encode(x[start:start + count], None) for start, count in pieces]
        self._end_pieces(x, parts)
        return [(payload, ctx) for _, payload, ctx in parts]

    def _compress_fused(self, x, pieces, layout):
        """compress_pieces through encode_feedback, piece by piece on views of x (checked)
        and of the residual (one call, one step)."""
        r = self.residual = self._state_like(self.residual, x)
        out = [self.encode_feedback(x[start:start + count], r[start:start + count], layout)
               for start, count in pieces]
        self.step += 1
        return out

    def _end(self, x, payload, ctx) -> None:
        self._end_pieces(x, [(0, payload, ctx)])

    def _end_pieces(self, x, parts) -> None:
        """After x (plus residual) went out as parts [(start, payload, ctx)] that tile it:
        keep what each dropped, count the call."""
        if self.error_feedback:
            if len(parts) == 1:
                self.residual = self.residual_of(x, parts[0][1], parts[0][2])
            else:
                r = get_array_module(x).empty_like(x)
                for start, payload, ctx in parts:
                    n = ctx["n"]
                    r[start:start + n] = self.residual_of(x[start:start + n], payload, ctx)
                self.residual = r
        self.step += 1

    # ---------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        """Per-rank state: step, residual (host copy, or None) and compressor extras."""
        sd = {"config": self.config(), "step": self.step,
              "residual": None if self.residual is None else to_numpy(self.residual).copy()}
        sd.update(self._extra_state())
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("config") != self.config():
            raise ValueError(f"checkpoint is for compressor {sd.get('config')}, this one is "
                             f"{self.config()}; build the compressor with the same options")
        self.step = int(sd["step"])
        res = sd["residual"]
        # a host copy; the next compress moves it to the gradient's device
        self.residual = None if res is None else np.array(res, dtype=np.float32)
        self._load_extra_state(sd)

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, sd: dict) -> None:
        return None
