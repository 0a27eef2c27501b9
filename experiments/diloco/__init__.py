"""DiLoCo against data parallel on slow links: validation loss per second and per byte.

The claim (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", 2023, arXiv 2311.08105): groups of workers that run H inner AdamW steps on their
own data and only then average their parameter deltas (the outer gradient, applied with
Nesterov momentum, outer lr 0.7, momentum 0.9) match fully synchronous data parallel
training while exchanging about H times less data; Streaming DiLoCo (Douillard et al.,
2025, arXiv 2501.18512) exchanges the model in fragments on staggered schedules. The experiment
asks: at 100 Mbit/s, does DiLoCo reach data parallel's final validation loss (within 3%) in
at most 1/4 of its wall time with at least 50x fewer bytes, and where does it lose?

The job: the byte-level GPT of jobs/torch_gpt.py (mpidist.torch.models.GPT, smaller here:
see SETTINGS), on data/sample.txt (the last 10% held out for validation), every rank
drawing its own windows per step; every variant trains for the same inner steps, so the
same tokens. Variants: data parallel (mpidist.torch.DistributedOptimizer, AdamW over all
ranks), DiLoCo (mpidist.torch.DiLoCo, the same AdamW within a group, one group per node)
at three H, and streaming DiLoCo (fragments=2). Bytes per rank are counted as the bar
defines them (data parallel: the ring's 2(n-1)/n x 4 x params per step; DiLoCo: what its
outer allreduce reports per sync) and the NIC counters of every simulated node are read
beside them.

Modules, each importing only those listed after it:
    driver   the command line: the jobs on the simulated cluster, then CSV, plot, section
    report   the section of docs/EXPERIMENTS.md: table and verdict
    plot     the figure
    rows     the workers' curves as CSV rows and one summary row per run
    worker   inside the MPI job: every variant's training run with its curve
"""
NAME = "diloco"
# The token budget (STEPS x BATCH windows of BLOCK bytes, the batch split evenly among
# the ranks, so every cluster shape trains on the same tokens) and the GPT: small
# enough that both cluster shapes at both rates fit in about 25 minutes of a 2-core VM,
# large enough that data parallel's per-step allreduce at 100 Mbit/s takes several times
# the step's compute. The paper's H = 25, 100, 500 unscaled: 40, 10 and 2 outer steps.
# Every run (data parallel and the inner AdamW alike) follows the paper's learning-rate
# shape: linear warm-up, then cosine decay, here to a tenth of the peak.
SETTINGS = {"steps": 1000, "batch": 8, "block": 64, "dim": 128, "layers": 2, "heads": 4,
            "lr": 3e-3, "warmup": 50, "end_lr": 3e-4, "outer_lr": 0.7,
            "outer_momentum": 0.9, "eval_every": 25, "eval_windows": 32,
            "H": (25, 100, 500), "stream_H": 100, "fragments": 2}
QUICK = {"steps": 40, "warmup": 5, "eval_every": 10, "H": (5, 20), "stream_H": 20}
SHAPES = "2x1,2x2"        # cluster shapes NODESxRANKS of a default run
