"""Training engine: Strategy interface and registry, DistributedOptimizer, config, loop."""
from mpidist.engine.distributed import DistributedOptimizer
from mpidist.engine.strategy import (STRATEGIES, InMemoryState, StateDict, Strategy, TensorPiece,
                                     build_strategy, register_strategy)

__all__ = ["DistributedOptimizer", "Strategy", "StateDict", "TensorPiece", "InMemoryState", "STRATEGIES",
           "register_strategy", "build_strategy"]
