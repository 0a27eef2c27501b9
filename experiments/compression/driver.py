"""The command line: one MPI job on local ranks measures every compressor, then the CSV,
the figure and the section (or, with --worker, be one rank of that job)."""
from __future__ import annotations

import json
import os
import tempfile
import time

import experiments.compression as package
from experiments import common
from experiments.compression import JOB, NAME, RANKS, worker
from experiments.compression.compressors import COMPRESSORS, QUICK
from experiments.compression.plot import plot
from experiments.compression.report import section
from experiments.compression.rows import curve, table_rows


def main(argv=None) -> int:
    args = common.parser(NAME, package.__doc__).parse_args(argv)
    if args.worker:
        return worker.main(args.worker)
    out = common.Outputs(NAME, args)
    cfg = {"epochs": 2 if args.quick else 12,
           "compressors": QUICK if args.quick else [c[0] for c in COMPRESSORS]}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mpidist-exp-") as tmp:
        spec = os.path.join(tmp, "spec.json")
        with open(spec, "w") as fh:
            json.dump({"config": os.path.join(common.REPO, JOB), "out": os.path.join(tmp, "runs"),
                       "compressors": list(cfg["compressors"]),
                       "overrides": {"job.epochs": cfg["epochs"], "job.progress": False,
                                     "job.plot": False, "job.target_accuracy": 0.0,
                                     "job.eval_every": 0, "checkpoint.interval": 0,
                                     "data.cache_dir": os.path.join(tmp, "data")}}, fh)
        res = common.run_local(NAME, RANKS, [spec], timeout=1800, what="compression runs")
        curves = {label: curve(r["out"]) for label, r in res["runs"].items()}
    took = time.perf_counter() - t0
    rows = table_rows(res)
    out.write_csv(rows)
    plot(rows, curves, out.png, f"{JOB}, LAMB, {RANKS} ranks, {cfg['epochs']} epochs")
    out.write_section(section(rows, args, out, cfg, took, res["numel"]))
    return 0
