"""The optimizer machinery shared by SGD, AdamW, LARS and LAMB over a flat buffer.

An optimizer owns the global element range [offset, offset+count) of a `Layout` (everything by
default; a ZeRO or parameter-server shard otherwise). `step(params, grads)` updates that range
in place through one fused kernel; fp16/bf16 parameters are updated through an fp32 master copy
kept here, states are fp32. Non-finite gradients skip the step and say so.

Layer-wise optimizers (LARS, LAMB) need per-tensor norms. The kernels return partial sums of
squares for every segment of the layout (zero outside the range), the caller's `reduce_norms`
sums them across the shards (an allreduce in ZeRO), and the trust ratios follow from the
totals, so a tensor split across ranks gets the same ratio as an unsplit one.
See docs/ARCHITECTURE.md (optimizers).
"""
from __future__ import annotations

import abc
import numbers
from dataclasses import dataclass
from typing import Callable

import numpy as np
import ml_dtypes

from mpidist.flat import Layout
from mpidist.kernels.backend import get_array_module, is_cupy, to_numpy
from mpidist.optim.checks import check_lr, check_number, match_names
from mpidist.optim.groups import ParamGroups
from mpidist.optim.plan import Plan

__all__ = ["Optimizer", "LayerwiseOptimizer", "StepInfo", "Plan", "DEFAULT_EXCLUDE",
           "PARAM_DTYPES", "BACKENDS"]

# Names of tensors that layer-wise optimizers leave out of weight decay and trust-ratio
# adaptation by default: biases and normalisation parameters (fnmatch patterns, full name).
DEFAULT_EXCLUDE = ("*bias", "*norm*", "*bn*", "*.ln*", "ln*")

PARAM_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
BACKENDS = ("auto", "cpu", "cupy", "numba-cuda")


@dataclass
class StepInfo:
    """What one step did. trust_ratios: one per layout segment (LARS/LAMB), else None;
    entries outside the optimizer's range are the ones reduce_norms made global (1.0 where
    nothing was known)."""
    skipped: bool
    reason: str | None
    step: int
    lr: float
    trust_ratios: np.ndarray | None = None


class Optimizer(ParamGroups, abc.ABC):
    """Base of the flat-buffer optimizers; subclasses define `state_names` (or
    `_active_states`), `_update` and `hyper()`; hyperparameters per group of tensors come
    from ParamGroups. Not thread-safe; one instance per shard."""

    name = "optimizer"
    state_names: tuple[str, ...] = ()
    layerwise = False

    def __init__(self, layout: Layout, *, lr, weight_decay: float = 0.0, exclude=(),
                 offset: int = 0, count: int | None = None, param_dtype=None,
                 backend: str = "auto"):
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a mpidist.flat.Layout, got {type(layout).__name__}")
        for what, v in (("offset", offset), ("count", 0 if count is None else count)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"{what} must be an integer >= 0, got {v!r}")
        count = layout.numel - offset if count is None else count
        if offset + count > layout.numel:
            raise ValueError(f"range [{offset}, {offset + count}) exceeds the layout's "
                             f"{layout.numel} elements")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.layout = layout
        self.offset, self.count = int(offset), int(count)
        self._lr = check_lr(lr)
        self.weight_decay = check_number("weight_decay", weight_decay, 0.0)
        self.excluded = match_names(layout, exclude)
        self.exclude = tuple(exclude)
        self.backend = backend
        self.plan = Plan(layout, self.offset, self.count)
        self.step_count = 0
        self._state = {n: np.zeros(self.count, np.float32) for n in self._active_states()}
        self.param_dtype = None
        self._master_ready = False
        if param_dtype is not None:
            self._set_param_dtype(np.dtype(param_dtype))
        self._kernels = {}
        self._gscratch = None

    # ---- hyperparameters --------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The learning rate of the next step (a schedule is evaluated at step_count)."""
        return float(self._lr(self.step_count)) if callable(self._lr) else self._lr

    @lr.setter
    def lr(self, value):
        self._lr = check_lr(value)

    def hyper(self) -> dict:
        """The hyperparameters, as build_optimizer takes them (for logs and checkpoints)."""
        return {"lr": self._lr if not callable(self._lr) else repr(self._lr),
                "weight_decay": self.weight_decay, "exclude": list(self.exclude)}

    def _active_states(self) -> tuple[str, ...]:
        return self.state_names

    def seg_wd(self) -> np.ndarray:
        """Weight decay per layout segment (0 where excluded by name)."""
        if self._seg_wd is not None:
            return self._seg_wd
        return np.where(self.excluded, 0.0, self.weight_decay)

    # ---- state ------------------------------------------------------------------------
    def _set_param_dtype(self, dtype):
        if dtype not in PARAM_DTYPES:
            raise TypeError(f"parameters must be float32, float16 or bfloat16, got {dtype}")
        self.param_dtype = dtype
        if dtype != np.float32 and "master" not in self._state:
            xp = get_array_module(*self._state.values())
            self._state["master"] = xp.zeros(self.count, np.float32)

    def state_buffers(self) -> dict:
        """{state name: 1-D fp32 array over [offset, offset+count)} (live, not copies);
        'master' holds the fp32 weights when the parameters are fp16/bf16."""
        return dict(self._state)

    def extra_state(self) -> dict:
        """Small JSON-able state beside the per-element buffers, the same on every rank
        (1-bit LAMB's per-tensor ratios); checkpoints keep it with the scalars."""
        return {}

    def load_extra_state(self, extra: dict) -> None:
        """Restore what extra_state() returned."""

    def state_dict(self) -> dict:
        """Copies of the state over the range, the step count, the range and the
        hyperparameters (the latter for the record: load_state_dict does not apply them)."""
        return {"name": self.name, "step": self.step_count, "offset": self.offset,
                "count": self.count, "hyper": self.hyper(), "extra": self.extra_state(),
                "param_dtype": None if self.param_dtype is None else str(self.param_dtype),
                "state": {k: v.copy() for k, v in self._state.items()}}

    def load_state_dict(self, sd: dict) -> None:
        """Restore the step count and state buffers (each of length `count`)."""
        if not isinstance(sd, dict) or "state" not in sd or "step" not in sd:
            raise TypeError("load_state_dict expects a dict from state_dict() "
                            "(keys 'step' and 'state')")
        if sd.get("name", self.name) != self.name:
            raise ValueError(f"state dict of a {sd['name']!r} optimizer given to {self.name!r}")
        dtype = self.param_dtype
        if sd.get("param_dtype") is not None:
            dtype = np.dtype(getattr(ml_dtypes, sd["param_dtype"], None) or sd["param_dtype"])
            if self.param_dtype is not None and dtype != self.param_dtype:
                raise ValueError(f"state dict is for {dtype} parameters, this optimizer "
                                 f"holds {self.param_dtype} ones")
            if dtype not in PARAM_DTYPES:
                raise TypeError(f"parameters must be float32, float16 or bfloat16, got {dtype}")
        state = sd["state"]
        want = set(self._state) | ({"master"} if dtype not in (None, np.float32) else set())
        if set(state) != want:
            raise ValueError(f"state names {sorted(state)} do not match this optimizer's "
                             f"{sorted(want)}")
        for k, v in state.items():
            if getattr(v, "shape", None) != (self.count,):
                raise ValueError(f"state {k!r} must have shape ({self.count},) for range "
                                 f"[{self.offset}, {self.offset + self.count}), got "
                                 f"{getattr(v, 'shape', None)}")
            if np.dtype(v.dtype) != np.float32:
                raise TypeError(f"state {k!r} must be float32, got {v.dtype}")
        step = sd["step"]
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if dtype is not None:
            self._set_param_dtype(dtype)
        for k, v in state.items():
            dst = self._state[k]
            dst[...] = to_numpy(v) if isinstance(dst, np.ndarray) else \
                get_array_module(dst).asarray(v)
        self.step_count = int(step)
        self._master_ready = self.step_count > 0
        if "extra" in sd:
            self.load_extra_state(sd["extra"])

    # ---- the step ---------------------------------------------------------------------
    def step(self, params, grads, reduce_norms: Callable | None = None, *,
             finite: bool | None = None, loss_scale: float = 1.0) -> StepInfo:
        """Update params over the range in place from grads (both 1-D, length count).

        grads are divided by loss_scale first (dynamic loss scaling). Non-finite grads skip
        the step (params and states untouched). finite=True/False overrides the local check
        with a flag the caller agreed across ranks. reduce_norms: see the module docstring.
        """
        kern, work, g = self._prepare(params, grads, loss_scale, finite, reduce_norms)
        if finite is False:
            return self._skip("finite=False given by the caller")
        if self._runs is None:
            info = self._update(kern, work, g, 1.0 / float(loss_scale), self.lr, reduce_norms,
                                finite)
        else:
            info = self._update_groups(kern, work, g, 1.0 / float(loss_scale), reduce_norms,
                                       finite)
        if not info.skipped and work is not params:
            params[...] = work.astype(params.dtype)
        return info

    def _prepare(self, params, grads, loss_scale, finite=None, reduce_norms=None):
        """Check the arguments; return (kernels, fp32 weights to update, fp32 grads)."""
        xp = self._check(params, grads, loss_scale, finite, reduce_norms)
        kern = self._kernels_for(xp)
        g = grads
        if grads.dtype != np.float32:
            if self._gscratch is None or get_array_module(self._gscratch) is not xp:
                self._gscratch = xp.empty(self.count, np.float32)
            self._gscratch[...] = grads
            g = self._gscratch
        if self.param_dtype == np.float32:
            return kern, params, g
        work = self._state["master"]
        if not self._master_ready:
            work[...] = params.astype(np.float32)
            self._master_ready = True
        return kern, work, g

    def _skip(self, reason: str, trust=None) -> StepInfo:
        return StepInfo(True, reason, self.step_count, self.lr, trust)

    def _done(self, lr: float, trust=None) -> StepInfo:
        self.step_count += 1
        return StepInfo(False, None, self.step_count, lr, trust)

    @abc.abstractmethod
    def _update(self, kern, work, g, gscale, lr, reduce_norms, finite) -> StepInfo:
        """Check finiteness (or take `finite`), run the kernels on fp32 weights `work`."""

    def _check(self, params, grads, loss_scale, finite, reduce_norms):
        """Validate the step's arguments; returns the array module."""
        for what, a in (("params", params), ("grads", grads)):
            if not (isinstance(a, np.ndarray) or is_cupy(a)):
                raise TypeError(f"{what} must be a NumPy or CuPy array, got {type(a).__name__}")
            if a.ndim != 1 or a.shape[0] != self.count:
                raise ValueError(f"{what} must be 1-D with {self.count} elements (the range "
                                 f"[{self.offset}, {self.offset + self.count})), got {a.shape}")
            if not a.flags.c_contiguous:
                raise ValueError(f"{what} must be contiguous; pass a slice of the flat buffer")
        if is_cupy(params) != is_cupy(grads):
            raise TypeError("params and grads must both be NumPy or both be CuPy arrays")
        dtype = np.dtype(params.dtype)
        if self.param_dtype is None:
            self._set_param_dtype(dtype)
        elif dtype != self.param_dtype:
            raise TypeError(f"params are {dtype} but this optimizer holds state for "
                            f"{self.param_dtype} parameters")
        if np.dtype(grads.dtype) not in (np.dtype(np.float32), dtype):
            raise TypeError(f"grads must be float32 or {dtype} like the params, got {grads.dtype}")
        check_number("loss_scale", loss_scale, 0.0, lo_open=True)
        if finite is not None and not isinstance(finite, (bool, np.bool_)):
            raise TypeError(f"finite must be None or a bool, got {type(finite).__name__}")
        if reduce_norms is not None and not callable(reduce_norms):
            raise TypeError("reduce_norms must be None or a callable(partials) -> summed partials")
        xp = get_array_module(params)
        for k, v in self._state.items():
            if get_array_module(v) is not xp:
                self._state[k] = xp.asarray(v) if xp is not np else v.get()
        return xp

    def _kernels_for(self, xp):
        backend = self.backend
        if backend == "auto":
            backend = "cupy" if xp is not np else "cpu"
        if backend == "cpu" and xp is not np:
            raise TypeError("backend='cpu' needs NumPy arrays; got CuPy arrays")
        if backend == "cupy" and xp is np:
            raise TypeError("backend='cupy' needs CuPy arrays; got NumPy arrays")
        if backend not in self._kernels:
            # each kernel set loads Numba or CuPy, so only the one in use is imported
            if backend == "cpu":
                from mpidist.kernels.optim_cpu import CPUKernels as K            # Numba
            elif backend == "cupy":
                from mpidist.kernels.optim_cupy import CuPyKernels as K          # CuPy
            else:
                from mpidist.kernels.optim_numba_cuda import NumbaCudaKernels as K  # Numba CUDA
            self._kernels[backend] = K(self.plan)
        return self._kernels[backend]

    def _empty(self, like):
        """A zero-length fp32 array beside `like` (for a state a kernel does not use)."""
        return get_array_module(like).zeros(0, np.float32)

    def _reduced(self, partials: np.ndarray, reduce_norms) -> np.ndarray:
        """Sum the per-segment partials across shards through reduce_norms (checked)."""
        if reduce_norms is None:
            return partials
        out = np.asarray(reduce_norms(partials.copy()), dtype=np.float64)
        if out.shape != partials.shape:
            raise ValueError(f"reduce_norms returned shape {out.shape}; it must return the "
                             f"summed partials with the shape it was given, {partials.shape}")
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.layout!r}, range=[{self.offset}, "
                f"{self.offset + self.count}), step={self.step_count})")


class LayerwiseOptimizer(Optimizer):
    """An optimizer with per-segment trust ratios (LARS, LAMB). Subclasses define
    `_sums(kern, w, g, gscale)` -> per-segment partials, `_trust(totals)` and `_apply`."""

    layerwise = True

    def partial_sums(self, params, grads, *, loss_scale: float = 1.0) -> np.ndarray:
        """This range's per-segment partial sums of squares, float64 (len(layout), k): what
        step() hands to reduce_norms. For a caller that holds several pieces of the buffer
        and sums their partials itself before giving the total back through reduce_norms."""
        kern, work, g = self._prepare(params, grads, loss_scale)
        return self._sums(kern, work, g, 1.0 / float(loss_scale))

    def _update(self, kern, work, g, gscale, lr, reduce_norms, finite):
        # 1. per-segment partial sums of squares over my range (the last column is ||g||^2)
        partials = self._sums(kern, work, g, gscale)
        # 2. summed across the shards: every rank sees the same totals
        totals = self._reduced(partials, reduce_norms)
        ok = bool(np.isfinite(totals[:, -1].sum())) if finite is None else finite
        if not ok:
            return self._skip("non-finite gradients")
        # 3. trust ratios per segment (1 for excluded ones), then the fused update
        trust = np.where(self.excluded, 1.0, self._trust(totals))
        self._apply(kern, work, g, gscale, lr, trust)
        return self._done(lr, trust)

    @abc.abstractmethod
    def _sums(self, kern, work, g, gscale) -> np.ndarray:
        """Per-segment partial sums of squares over my range; last column ||g||^2."""

    @abc.abstractmethod
    def _trust(self, totals: np.ndarray) -> np.ndarray:
        """Trust ratio per layout segment from the summed partials."""

    @abc.abstractmethod
    def _apply(self, kern, work, g, gscale, lr, trust) -> None:
        """The fused element-wise update with per-segment factors lr*trust."""
