"""ZeRO: data parallelism without redundant model states.

Stage 1 partitions the optimizer states, stage 2 also the gradients, stage 3 also the
parameters, each over the chunk() shards of the flat layout, on mpidist's own collectives.
`build_zero(stage, model, make_optimizer, ...)` picks the engine; `memory_report()` says,
from the buffers actually allocated, what each rank holds.
See docs/ARCHITECTURE.md (ZeRO).
"""
from mpidist.zero.engine import ZeroEngine, check_stage
from mpidist.zero.memory import MemoryReport, model_state_bytes, paper_bytes_per_param
from mpidist.zero.stage1 import Stage1
from mpidist.zero.stage2 import Stage2
from mpidist.zero.stage3 import Stage3

__all__ = ["build_zero", "ZeroEngine", "Stage1", "Stage2", "Stage3", "STAGES", "MemoryReport",
           "model_state_bytes", "paper_bytes_per_param"]

STAGES = {1: Stage1, 2: Stage2, 3: Stage3}


def build_zero(stage, model, make_optimizer, **kwargs) -> ZeroEngine:
    """The ZeRO engine of `stage` (1, 2 or 3) over model; kwargs as ZeroEngine takes them.

    The stage is checked before any work (a ValueError naming the valid stages).
    """
    return STAGES[check_stage(stage)](model, make_optimizer, **kwargs)
