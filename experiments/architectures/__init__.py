"""Parameter server vs peer-to-peer vs ring vs hierarchical allreduce on the simulated cluster.

The claim (Alqahtani and Demirbas, "Performance Analysis and Comparison of Distributed
Machine Learning Systems", 2019): ring allreduce decouples network usage from the number
of workers; one parameter server (PS) suffers congestion at the server; peer-to-peer (P2P,
every worker serves a shard) is better than one PS but still bottlenecked; and the ring
overlaps computation with communication, which PS and P2P do not.

Phase A: 1 rank per node, p = 2..W workers: 1 PS, 2 PS, P2P, ring.
Phase B: N nodes x 2 ranks: flat ring, hierarchical, P2P, MPI_Allreduce.
Phase C: compute and communication overlapped (allreduce_async per layer) or not.
Measured per step: the slowest rank's time (median over rounds) and every NIC's bytes.

Modules, each importing only those listed after it:
    driver   the command line: starts the phases on the cluster, writes CSV, plot, section
    report   the section of docs/EXPERIMENTS.md: table and verdict
    plot     the figure
    rows     the workers' results as table rows, beside the models' predictions
    worker   phases A and B inside the MPI job;  overlap  phase C inside the MPI job
    p2p      the P2P allreduce (all-to-all reduce-scatter and all-gather)
    model    the paper's bandwidth model and mpidist's fitted alpha-beta-gamma model
"""
NAME = "architectures"
