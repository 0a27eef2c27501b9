"""Dynamic loss scaling for fp16/bf16 training (Micikevicius et al. 2018).

The loss is multiplied by `scale` before backward so small gradients survive half precision;
the optimizer divides the gradients by it again (step(..., loss_scale=scale)). On an
overflow (non-finite gradients) the step is skipped and the scale multiplied by
backoff_factor; after growth_interval clean steps in a row it is multiplied by growth_factor.
See docs/ARCHITECTURE.md (optimizers).
"""
from __future__ import annotations

from mpidist.optim.base import StepInfo
from mpidist.optim.checks import check_number

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """Holds the loss scale; `step()` runs an optimizer step with it and adapts it."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 1.0, max_scale: float = 2.0 ** 24):
        self.scale = check_number("init_scale", init_scale, 0.0, lo_open=True)
        self.growth_factor = check_number("growth_factor", growth_factor, 1.0, lo_open=True)
        self.backoff_factor = check_number("backoff_factor", backoff_factor, 0.0, 1.0,
                                           lo_open=True, hi_open=True)
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) \
                or growth_interval < 1:
            raise ValueError(f"growth_interval must be an integer >= 1, got {growth_interval!r}")
        self.growth_interval = growth_interval
        self.min_scale = check_number("min_scale", min_scale, 0.0, lo_open=True)
        self.max_scale = check_number("max_scale", max_scale, self.min_scale)
        if not self.min_scale <= self.scale <= self.max_scale:
            raise ValueError(f"init_scale {init_scale} must lie in [min_scale, max_scale] = "
                             f"[{self.min_scale}, {self.max_scale}]")
        self.good_steps = 0
        self.overflows = 0

    def step(self, optimizer, params, grads, reduce_norms=None, *, finite=None) -> StepInfo:
        """optimizer.step with the current scale, then update(); returns the step's info."""
        info = optimizer.step(params, grads, reduce_norms, finite=finite, loss_scale=self.scale)
        self.update(not info.skipped)
        return info

    def update(self, finite: bool) -> None:
        """Adapt the scale after a step whose gradients were (not) finite."""
        if not finite:
            self.overflows += 1
            self.good_steps = 0
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.good_steps = 0
            self.scale = min(self.max_scale, self.scale * self.growth_factor)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "overflows": self.overflows}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = check_number("scale", sd["scale"], 0.0, lo_open=True)
        self.good_steps = int(sd["good_steps"])
        self.overflows = int(sd["overflows"])
