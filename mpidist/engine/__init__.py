"""Training engine, the application layer: config and schema, the strategies registry
(engine.strategies), the loop, DistributedOptimizer and the data-parallel strategies. What
the strategies themselves build on (the Strategy base, builders, 1-bit exchange, metrics)
lives below it, in mpidist.strategy; the state types in mpidist.state."""
from mpidist.engine.distributed import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
