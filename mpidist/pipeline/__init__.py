"""Pipeline parallelism: schedules as data (GPipe, 1F1B, interleaved 1F1B), stage
partitioning, an executor with nonblocking transfers (pipeline.executor), per-stage timing
(pipeline.timing), and the pp x dp training strategy (pipeline.strategy, strategy =
"pipeline" in a job). Importing the package loads only the pure parts: no MPI.

    from mpidist.pipeline import build_schedule, format_grid, validate
    print(format_grid(build_schedule("1f1b", pp=4, microbatches=8)))

See docs/ARCHITECTURE.md (pipeline).
"""
from mpidist.pipeline.cuts import balanced_bounds, by_cost, by_cuts, by_params, stage_bounds
from mpidist.pipeline.actions import Action, Schedule
from mpidist.pipeline.schedules import (PIPELINE_SCHEDULES, build_schedule, format_grid, gpipe,
                                        ideal_bubble, interleaved_1f1b, one_f_one_b)
from mpidist.pipeline.rules import validate

__all__ = ["Action", "Schedule", "PIPELINE_SCHEDULES", "build_schedule", "gpipe", "one_f_one_b",
           "interleaved_1f1b", "validate", "format_grid", "ideal_bubble", "balanced_bounds",
           "by_params", "by_cost", "by_cuts", "stage_bounds"]
