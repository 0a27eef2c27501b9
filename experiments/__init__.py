"""The seed documents' claims as experiments, one module per claim:

    python -m experiments.architectures [--quick]   PS vs P2P vs ring vs hierarchical (seed 003)
    python -m experiments.centralized [--quick]     "75% of the communication overhead" (seed 000)
    python -m experiments.consistency [--quick]     sync / async / bounded staleness / ADMM (seed 000)
    python -m experiments.large_batch [--quick]     the large-batch table (seed 002, Table 2)
    python -m experiments.compression [--quick]     bytes vs accuracy per compressor with LAMB (seed 002)

A full run writes docs/experiments/NAME.csv and .png and replaces its section of
docs/EXPERIMENTS.md; --quick (seconds to two minutes, for the tests) writes the same files
under results/experiments/NAME-quick/ and leaves docs/ alone. The network experiments run
on the simulated cluster (mpidist.simcluster: root and iproute2); the others start their
ranks with mpidist.launcher. Run them from the repository root.
"""
