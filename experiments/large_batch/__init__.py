"""The large-batch table: final accuracy of SGD, LARS, LAMB and AdamW as the global batch
grows, each with its learning-rate scaling rule.

The claim (Table 2 of Singh, "Architectural Evolution in Distributed Training: From Parameter Servers to
Zero Redundancy Systems", IJFMR 2025): the largest batch at which each trains stably is SGD 8K,
LARS 16K, LAMB 32K+, AdamW 8K. The jobs are the shipped jobs/large_batch_{sgd,lars,lamb,adamw}.toml
(their optimizers and hyperparameters) moved to a task big enough for batches in the
thousands: mpidist's synthetic classification set (Gaussian clusters, generated, no
download) with --set overrides, the same epochs at every batch size (the same compute), so
a larger batch means fewer, larger steps. Learning rates follow the usual rules from the
jobs' own tuned values: linear scaling for SGD and LARS from SGD's lr 0.05 at batch 32
(Goyal et al. 2017; LARS runs at SGD's lr, its trust ratio tames it), square-root scaling
for LAMB and AdamW from their lr at batch 1024 (You et al. 2020). Warm-up: a tenth of the
steps, then cosine decay.

Modules, each importing only those listed after it:
    driver  the command line: every optimizer at every batch in one MPI job, CSV, plot, section
    report  the section of docs/EXPERIMENTS.md;  plot  the figure
    runs    each run's overrides, and its metrics as a row
    model   the learning-rate rules, the paper's table and what counts as stable
"""
NAME = "large_batch"
