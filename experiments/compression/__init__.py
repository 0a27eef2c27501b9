"""Bytes sent against accuracy for each gradient compressor, training with LAMB.

The claim (Singh, "Architectural Evolution in Distributed Training: From Parameter Servers
to Zero Redundancy Systems", IJFMR 2025): gradient compression and quantization "work
harmoniously with adaptive optimizers like LAMB", keeping its large-batch behaviour while
cutting communication. The job is the shipped jobs/digits_lamb.toml (an MLP on the digits,
LAMB, data parallel on 4 ranks), trained once uncompressed and once per compressor for the
same epochs. Bytes are exact: each compressor's `CompressedAllreduce` on the job's own
parameter layout reports the bytes every rank sent (the largest rank's), against the
float32 ring's 2(p-1)/p; per run, that times the optimizer steps.

Modules, each importing only those listed after it:
    driver       the command line: the MPI job, then CSV, plot and section
    report       the section of docs/EXPERIMENTS.md;  plot  the figure
    rows         the job's result as table rows; a run's accuracy curve
    worker       inside the MPI job: bytes per compressor, then one training run each
    compressors  the compressors compared, and what "keeps the accuracy" means
"""
NAME = "compression"
JOB = "jobs/digits_lamb.toml"
RANKS = 4
