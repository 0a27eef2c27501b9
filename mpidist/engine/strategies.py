"""Every training strategy by its [parallel] strategy name, and build_strategy.

The one place that lists them: engine.config takes its choices, per-strategy keys and
support rules from STRATEGIES, and the loop builds the configured one from it.
"""
from __future__ import annotations

from mpidist.admm import ADMMStrategy
from mpidist.engine.diloco import DiLoCo, LocalSGD
from mpidist.engine.diloco_async import AsyncDiLoCo
from mpidist.engine.dp import DataParallel
from mpidist.errors import ConfigError
from mpidist.pipeline.strategy import PipelineStrategy
from mpidist.ps.strategy import ParameterServerStrategy
from mpidist.strategy.base import Strategy
from mpidist.zero.strategy import ZeroStrategy

__all__ = ["STRATEGIES", "build_strategy"]

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (DataParallel, ZeroStrategy, PipelineStrategy, ParameterServerStrategy,
                              ADMMStrategy, DiLoCo, LocalSGD, AsyncDiLoCo)}


def build_strategy(config: dict, comm, meta: dict) -> Strategy:
    """Collective: build the configured strategy on every rank of comm."""
    name = config["parallel"]["strategy"]
    if name not in STRATEGIES:
        raise ConfigError(f"unknown parallel.strategy {name!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[name](config, comm, meta)
