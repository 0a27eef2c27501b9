"""Training engine: DistributedOptimizer, the Strategy interface and its strategies
(engine.strategies), config, loop. The state types live below it, in mpidist.state."""
from mpidist.engine.distributed import DistributedOptimizer
from mpidist.engine.strategy import Strategy

__all__ = ["DistributedOptimizer", "Strategy"]
