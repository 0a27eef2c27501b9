"""The command line: the runs on the simulated cluster, alternating the two
architectures, then the CSV, the figure and the section."""
from __future__ import annotations

import tempfile
import time

import experiments.centralized as package
from experiments import common
from experiments.centralized import NAME
from experiments.centralized.overhead import overheads
from experiments.centralized.plot import plot
from experiments.centralized.report import section
from experiments.centralized.runs import train_once


def main(argv=None) -> int:
    args = common.parser(NAME, package.__doc__).parse_args(argv)
    common.need_cluster()
    from mpidist.simcluster import SimCluster
    out = common.Outputs(NAME, args)
    bw = "100mbit"
    from mpidist.simcluster import parse_rate
    if args.quick:
        cfg = {"workers": [2], "steps": 6, "hidden": [256], "features": 128, "samples": 2048,
               "batch": 128, "rounds": 1}
    else:
        cfg = {"workers": [2, 3, 4], "steps": 16, "hidden": [512, 512], "features": 256,
               "samples": 8192, "batch": 256, "rounds": 2}
    cfg["rate"] = parse_rate(bw)
    dims = [cfg["features"], *cfg["hidden"], 10]
    cfg["params"] = sum(a * b + b for a, b in zip(dims, dims[1:]))
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpidist-exp-") as tmp, \
            SimCluster(nodes=max(cfg["workers"]) + 1, ranks_per_node=1, bandwidth=bw) as cluster:
        for rnd in range(cfg["rounds"]):
            for p in cfg["workers"]:
                order = (True, False) if (rnd + p) % 2 == 0 else (False, True)
                for central in order:
                    rows.append(train_once(cluster, p, central, cfg, tmp, rnd))
    took = time.perf_counter() - t0
    rows = overheads(rows)
    out.write_csv(rows)
    plot(rows, out.png, f"same job, centralized vs decentralized, {bw} links")
    out.write_section(section(rows, args, out, cfg, bw, took))
    return 0
