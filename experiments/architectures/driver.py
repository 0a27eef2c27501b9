"""The command line: start the three phases on the simulated cluster, then write the CSV,
the figure and the section (or, with --worker, be one rank of a phase's MPI job)."""
from __future__ import annotations

import time

import experiments.architectures as package
from experiments import common
from experiments.architectures import NAME, worker
from experiments.architectures.model import fit_of
from experiments.architectures.plot import plot
from experiments.architectures.report import section
from experiments.architectures.rows import hidden_fractions, measured_rows, overlap_rows


def main(argv=None) -> int:
    args = common.parser(NAME, package.__doc__).parse_args(argv)
    if args.worker:
        worker.main(args.worker)
        return 0
    common.need_cluster()
    from mpidist.simcluster import SimCluster, parse_rate
    out = common.Outputs(NAME, args)
    bw = "100mbit"
    rate = parse_rate(bw) / 8
    if args.quick:
        cfg = {"W": 3, "n": 1 << 16, "iters": 2, "rounds": 1, "probe_s": 2, "nodes_b": 2}
    else:
        cfg = {"W": 4, "n": 1 << 19, "iters": 3, "rounds": 3, "probe_s": 8, "nodes_b": 3}
    t0 = time.perf_counter()
    spec = (f"n={cfg['n']},iters={cfg['iters']},rounds={cfg['rounds']},"
            f"probe_s={cfg['probe_s']}")
    with SimCluster(nodes=cfg["W"] + 2, ranks_per_node=1, bandwidth=bw) as cluster:
        res_a = common.run_cluster(NAME, cluster, [f"phase=A,workers={cfg['W']}," + spec],
                                   timeout=1800, what="phase A", thread_level="serialized")
        # the overlap needs MPI_THREAD_MULTIPLE (allreduce_async's worker thread)
        res_c = common.run_cluster(NAME, cluster, ["phase=C," + spec], np=cfg["W"],
                                   timeout=1800, what="phase C", thread_level="multiple")
    with SimCluster(nodes=cfg["nodes_b"], ranks_per_node=2, bandwidth=bw) as cluster:
        res_b = common.run_cluster(NAME, cluster, ["phase=B," + spec], timeout=1800,
                                   what="phase B", thread_level="serialized")
    cfg["took"] = time.perf_counter() - t0
    cfg["fit"] = fit_of(res_a["model"])
    cfg["hidden"] = hidden_fractions(res_c)
    rows_a, rows_b = measured_rows(res_a, "A", rate), measured_rows(res_b, "B", rate)
    rows_c = overlap_rows(res_c, cfg["W"], res_a["n"] * 4)
    out.write_csv(rows_a + rows_b + rows_c)
    plot(rows_a, rows_b, out.png, f"simulated cluster, {bw} links, "
                                  f"{rows_a[0]['model_MiB']:.2f} MiB model")
    out.write_section(section(rows_a, rows_b, rows_c, args, out, bw, cfg))
    return 0
