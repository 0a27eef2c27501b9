"""`mpidist bench ft`: how long training stops when a rank dies, against world size and model size.

    MPIDIST_MPI=ompi5-ft bash scripts/setup_env.sh          # the FT environment (Open MPI 5, ULFM)
    source <its path>/bin/activate
    mpidist bench ft                                         # ranks 2,3,4 x hidden 256,1024,2048
    mpidist bench ft --ranks 4 --hidden 256,4096 --reps 3

What it measures, and how: main()'s docstring. See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from mpidist.launcher import ft_supported
from mpidist.sizes import positive_ints

__all__ = ["main"]

JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   "jobs", "digits_lamb.toml")


def _parse(argv):
    p = argparse.ArgumentParser(prog="mpidist bench ft", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=positive_ints, default=[2, 3, 4], help="world sizes at start (>= 2)")
    p.add_argument("--hidden", type=positive_ints, default=[256, 1024, 2048], help="hidden layer widths")
    p.add_argument("--steps", type=int, default=40, help="training steps per run")
    p.add_argument("--kill-at", type=int, default=15, help="the last rank dies in the step after this one")
    p.add_argument("--reps", type=int, default=1, help="repetitions (the runs take turns)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    args = p.parse_args(argv)
    if min(args.ranks) < 2:
        p.error("--ranks: a run needs at least 2 ranks (one dies)")
    if not 0 < args.kill_at < args.steps - 1:
        p.error("--kill-at must be between 1 and --steps - 2")
    return args


def _run(ranks: int, hidden: int, args, out: str) -> dict:
    """One job; its recovery record and parameter count."""
    cmd = [sys.executable, "-m", "mpidist.launcher", "--ft", "-n", str(ranks), "--",
           sys.executable, "-m", "mpidist", "train", JOB, "--out", out,
           "--set", f"model.hidden=[{hidden}, {hidden}]", "--set", f"job.steps={args.steps}",
           "--set", "job.fault_tolerance='shrink'", "--set", "job.progress=false",
           "--set", "job.plot=false", "--set", "job.target_accuracy=0", "--set", "checkpoint.interval=0"]
    env = {**os.environ, "MPIDIST_FT_KILL": f"{ranks - 1}@{args.kill_at}"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{ranks} ranks, hidden {hidden}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as fh:
        summary = json.load(fh)
    with open(os.path.join(out, f"killed-rank{ranks - 1}.txt")) as fh:
        killed = float(fh.read())
    rec = summary["recoveries"][0]
    return {"params": summary["memory"]["params"] // 4, "recovery": rec["seconds"],
            "kill_to_step": rec["done_at"] - killed}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code.

    Each measurement is the main job (jobs/digits_lamb.toml, data parallel, LAMB) with two
    hidden layers of the given width, `--steps` steps, fault_tolerance = "shrink", started with
    `mpiexec --with-ft ulfm`; the last rank SIGKILLs itself during the step after `--kill-at`
    (ft.recovery's fault injection). Reported per run: the parameters, the seconds from the
    kill to the first step completed on the survivors ("kill->step", which includes failure
    detection), and from noticing the failure to that step ("recovery": shrink, agreement,
    broadcast of the replica, rebuilding the strategy and the step itself). The runs take
    turns (every configuration once per repetition), medians over repetitions.
    """
    args = _parse(argv)
    if not ft_supported():
        print("mpidist bench ft: this MPI has no fault tolerance (ULFM); build the FT environment "
              "with `MPIDIST_MPI=ompi5-ft bash scripts/setup_env.sh` and run from it", file=sys.stderr)
        return 2
    configs = [(r, h) for r in args.ranks for h in args.hidden]
    results: dict = {c: [] for c in configs}
    print(f"# mpidist bench ft: main job, {args.steps} steps, last rank killed after step {args.kill_at}, "
          f"{args.reps} repetition(s), medians; {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="mpidist-bench-ft-") as tmp:
        for rep in range(args.reps):
            for ranks, hidden in configs:
                out = os.path.join(tmp, f"r{ranks}-h{hidden}-{rep}")
                results[(ranks, hidden)].append(_run(ranks, hidden, args, out))
    print(f"{'ranks':>5} {'->':>3} {'hidden':>6} {'params':>10} {'MB':>7} {'kill->step s':>13} {'recovery s':>11}")
    for (ranks, hidden), runs in results.items():
        params = runs[0]["params"]
        k2s = statistics.median(r["kill_to_step"] for r in runs)
        rec = statistics.median(r["recovery"] for r in runs)
        print(f"{ranks:>5} {ranks - 1:>3} {hidden:>6} {params:>10} {params * 4 / 2**20:>7.1f} "
              f"{k2s:>13.2f} {rec:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
