"""The claims of the papers mpidist started from, as experiments, one package per claim:

    python -m experiments.architectures [--quick]   ring allreduce decouples network usage from
                                                    the worker count (Alqahtani and Demirbas, 2019)
    python -m experiments.centralized [--quick]     decentralized training "eliminates 75% of the
                                                    communication overhead" (Yang, ICIAAI 2025)
    python -m experiments.consistency [--quick]     sync / async SGD / ADMM: communication against
                                                    stable convergence (Yang, ICIAAI 2025)
    python -m experiments.large_batch [--quick]     the largest stable batch per optimizer
                                                    (Singh, IJFMR 2025, Table 2)
    python -m experiments.compression [--quick]     compression keeps LAMB's accuracy while
                                                    cutting bytes (Singh, IJFMR 2025)

Each package holds its model, its MPI worker (or the runs it starts), its plot, its report
and a driver; `common` is what they share. A full run writes docs/experiments/NAME.csv and
.png and replaces its section of docs/EXPERIMENTS.md; --quick (seconds to two minutes, for
the tests) writes the same files under results/experiments/NAME-quick/ and leaves docs/
alone. The network experiments run on the simulated cluster (mpidist.simcluster: root and
iproute2); the others start their ranks with mpidist.launcher. Run them from the
repository root.
"""
