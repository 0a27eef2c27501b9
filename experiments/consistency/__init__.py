"""Synchronous vs asynchronous vs bounded-staleness SGD vs ADMM: accuracy against wall time,
with and without a straggler.

The claim (Yang, "Analysis of Distributed Training Systems and Optimization Algorithms",
ICIAAI 2025): synchronous SGD, asynchronous SGD and ADMM trade communication cost against
the stability of convergence; stragglers and staleness are what the trade is about. The jobs
are the shipped ones (jobs/digits_ps_{bsp,asp,ssp}.toml: the parameter server with one
server and three workers; jobs/digits_admm.toml: consensus ADMM on three ranks), run with
`mpidist train` on local ranks with the same model, data, global batch (48), learning rate
and epochs. Stragglers: a fixed delay per step on the last worker (`straggler_mode =
"fixed"`, persistent) or on one worker drawn per step (`"random"`, transient); the engine
injects them only into the parameter server, so ADMM runs without. Wall time = rank 0's
summed step times (evaluation left out).

Modules, each importing only those listed after it:
    driver   the command line: the runs (one MPI job per rank count), CSV, plot, section
    report   the section of docs/EXPERIMENTS.md;  plot  the figure
    rows     a run's metrics as a row: accuracy curve, wall time, time to the target
    methods  the compared methods, straggler kinds and each run's overrides
"""
NAME = "consistency"
