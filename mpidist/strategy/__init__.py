"""What every strategy (dp, zero, pipeline, ps, admm, DiLoCo) builds on, below them all:

    base               the Strategy interface the training loop drives
    builders           model, optimizer, compression and schedule from a config
    compression_state  compression residuals as checkpoint pieces, at any world size
    onebit             the 1-bit optimizers' momentum exchange (dp, ZeRO, pipeline dp groups)
    metrics            rank-prefixed logging and the per-step metrics file

The engine (config, loop, registry) sits above the strategies; this package imports
neither them nor it.
"""
from mpidist.strategy.base import Strategy

__all__ = ["Strategy"]
