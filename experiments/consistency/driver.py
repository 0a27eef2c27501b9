"""The command line: every method with and without a straggler, in rounds, one MPI job
per rank count; then the CSV, the figure and the section."""
from __future__ import annotations

import os
import tempfile
import time

import experiments.consistency as package
from experiments import common
from experiments.consistency import NAME
from experiments.consistency.methods import KINDS, METHODS, overrides
from experiments.consistency.plot import plot
from experiments.consistency.report import section
from experiments.consistency.rows import row


def main(argv=None) -> int:
    args = common.parser(NAME, package.__doc__).parse_args(argv)
    out = common.Outputs(NAME, args)
    if args.quick:
        cfg = {"epochs": 1, "eval_every": 10, "delay": 0.02, "rounds": 1,
               "kinds": ("none", "fixed")}
    else:
        cfg = {"epochs": 12, "eval_every": 29, "delay": 0.02, "rounds": 2, "kinds": KINDS}
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpidist-exp-") as tmp:
        # one MPI job per rank count (the PS jobs on 4, ADMM on 3); rounds and the
        # straggler / no-straggler halves alternate inside each job
        for ranks in sorted({n for _, n, _ in METHODS.values()}, reverse=True):
            cases = [(rnd, kind, label) for rnd in range(cfg["rounds"])
                     for kind in (cfg["kinds"] if rnd % 2 == 0 else cfg["kinds"][::-1])
                     for label, (job, n, _) in METHODS.items()
                     if n == ranks and not (kind != "none" and "admm" in job)]
            runs = [(METHODS[label][0], overrides(label, kind, cfg, tmp),
                     os.path.join(tmp, f"{ranks}-{i}")) for i, (_, kind, label) in enumerate(cases)]
            # first a one-epoch run of the job's first case, thrown away: it pays for
            # compiling the kernels, which would otherwise land on one method's clock
            warm = (runs[0][0], {**runs[0][1], "job.epochs": 1}, os.path.join(tmp, f"{ranks}-warm"))
            results = common.train_many(ranks, [warm, *runs], 1800, tmp)[1:]
            for (rnd, kind, label), res in zip(cases, results):
                rows.append(dict(row(label, kind, cfg, *res), round=rnd))
    took = time.perf_counter() - t0
    out.write_csv([{k: v for k, v in r.items() if not k.startswith("curve")} for r in rows])
    plot(rows, out.png, "digits MLP, 3 workers, local ranks")
    out.write_section(section(rows, args, out, cfg, took))
    return 0
