"""Centralized (one parameter server) vs decentralized (ring allreduce): the same job.

The claim (Yang, "Analysis of Distributed Training Systems and Optimization Algorithms", ICIAAI 2025): a decentralized architecture "eliminates 75% of the communication
overhead" compared to a centralized one (case studies with TensorFlow and Horovod). Here
one `mpidist train` job (an MLP on synthetic data, synchronous SGD, the same global batch,
seed and steps) runs on the simulated cluster twice per worker count p: as
`strategy = "ps"` (BSP, one server on a node of its own) and as `strategy = "dp"` with the
ring allreduce. Communication overhead = the per-step time a worker spends communicating
(the job's wall time per step less a worker's compute); the NIC counters give bytes per step.
Under the bandwidth model of Alqahtani and Demirbas (2019) the reduction is 1 - (p-1)/p^2:
exactly 75% at p = 2, 81% at p = 4.

Modules, each importing only those listed after it:
    driver    the command line: the runs, then CSV, plot and section
    report    the section of docs/EXPERIMENTS.md;  plot  the figure
    overhead  communication overhead per step and its reduction, from the runs
    runs      one `mpidist train` job on the cluster and what it measured
    model     the bandwidth model's reduction
"""
NAME = "centralized"
JOB = "jobs/synthetic_mlp.toml"
