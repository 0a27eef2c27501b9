"""The command line: every optimizer at every batch size in one MPI job (`train_many`),
then the CSV, the figure and the section."""
from __future__ import annotations

import os
import tempfile
import time

import experiments.large_batch as package
from experiments import common
from experiments.large_batch import NAME
from experiments.large_batch.model import OPTIMIZERS
from experiments.large_batch.plot import plot
from experiments.large_batch.report import section
from experiments.large_batch.runs import overrides, row


def main(argv=None) -> int:
    args = common.parser(NAME, package.__doc__).parse_args(argv)
    out = common.Outputs(NAME, args)
    if args.quick:
        cfg = {"samples": 5120, "features": 16, "classes": 10, "hidden": [64], "epochs": 3,
               "batches": [128, 2048], "ranks": 2}
    else:
        cfg = {"samples": 40960, "features": 16, "classes": 10, "hidden": [128, 128],
               "epochs": 8, "batches": [256, 1024, 4096, 16384], "ranks": 2}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mpidist-exp-") as tmp:
        cases = [(opt, b, overrides(opt, b, cfg, tmp)) for b in cfg["batches"] for opt in OPTIMIZERS]
        runs = [(OPTIMIZERS[opt][0], over, os.path.join(tmp, f"{opt}-{b}")) for opt, b, over in cases]
        results = common.train_many(cfg["ranks"], runs, timeout=1800, tmp=tmp)
        rows = [row(opt, b, over, *res) for (opt, b, over), res in zip(cases, results)]
    took = time.perf_counter() - t0
    out.write_csv(rows)
    plot(rows, out.png, f"synthetic {cfg['features']}-d, {cfg['classes']} classes, "
                         f"{cfg['epochs']} epochs at every batch")
    out.write_section(section(rows, args, out, cfg, took))
    return 0
