"""Pipeline parallelism: schedules as data (GPipe, 1F1B, interleaved 1F1B), stage
partitioning, an executor with nonblocking transfers, per-stage timing, and the
pp x dp training strategy (mpidist.pipeline.strategy, strategy = "pipeline" in a job).

    from mpidist.pipeline import build_schedule, format_grid, validate
    print(format_grid(build_schedule("1f1b", pp=4, microbatches=8)))
"""
from mpidist.pipeline.executor import PipelineExecutor, StepStats
from mpidist.pipeline.partition import balanced_bounds, by_cost, by_cuts, by_params, stage_bounds
from mpidist.pipeline.schedules import (SCHEDULES, Action, Schedule, build_schedule, format_grid,
                                        gpipe, ideal_bubble, interleaved_1f1b, one_f_one_b,
                                        validate)
from mpidist.pipeline.stage import Stage, local_stages, materialize_stages, pipeline_layers

__all__ = ["Action", "Schedule", "SCHEDULES", "build_schedule", "gpipe", "one_f_one_b",
           "interleaved_1f1b", "validate", "format_grid", "ideal_bubble", "balanced_bounds",
           "by_params", "by_cost", "by_cuts", "stage_bounds", "Stage", "pipeline_layers",
           "local_stages", "materialize_stages", "PipelineExecutor", "StepStats"]
