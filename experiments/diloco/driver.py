"""The command line: one MPI job per (cluster shape, link rate) on the simulated cluster,
each running every variant, then the CSV, the figure and the section (or, with --worker,
be one rank of such a job)."""
from __future__ import annotations

import json
import time

import experiments.diloco as package
from experiments import common
from experiments.diloco import NAME, QUICK, SETTINGS, SHAPES, worker
from experiments.diloco.plot import plot
from experiments.diloco.report import section
from experiments.diloco.rows import curve_rows, summary_rows

RATES = ("100mbit", "1gbit")


def main(argv=None) -> int:
    p = common.parser(NAME, package.__doc__)
    p.add_argument("--shapes", default=None,
                   help=f"cluster shapes NODESxRANKS, comma-separated (default {SHAPES}; "
                        f"--quick: {SHAPES.split(',')[0]}, a check that the outputs are written)")
    args = p.parse_args(argv)
    if args.worker:
        worker.main(args.worker)
        return 0
    common.need_cluster()
    from mpidist.simcluster import SimCluster
    out = common.Outputs(NAME, args)
    cfg = dict(SETTINGS, **(QUICK if args.quick else {}))
    given = args.shapes or (SHAPES.split(",")[0] if args.quick else SHAPES)
    shapes = [tuple(int(v) for v in s.split("x")) for s in given.split(",")]
    t0 = time.perf_counter()
    results = []
    for nodes, per_node in shapes:
        for rate in RATES:
            with SimCluster(nodes=nodes, ranks_per_node=per_node, bandwidth=rate) as cluster:
                res = common.run_cluster(NAME, cluster, [json.dumps(cfg)], timeout=1800,
                                         what=f"{nodes}x{per_node} at {rate}")
            res["rate"] = rate
            results.append(res)
            print(f"{nodes}x{per_node} at {rate}: done after "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    cfg["took"] = time.perf_counter() - t0
    out.write_csv(curve_rows(results))
    summary = summary_rows(results)
    plot(results, out.png, f"GPT ({results[0]['runs'][0]['params'] / 1e6:.2f}M parameters), "
                           f"{cfg['steps']} inner steps per rank, simulated cluster")
    out.write_section(section(summary, args, out, cfg))
    return 0
