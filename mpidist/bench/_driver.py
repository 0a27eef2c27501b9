"""The driver the torch benchmarks share: alone, a benchmark starts one MPI job per rank
count, each running its own worker (`mpidist bench NAME --worker --json PATH ...`), and
reports the rows it collects; under mpiexec (or with --worker) it is that worker.
See docs/BENCHMARKS.md."""
from __future__ import annotations

import json
import os
import sys
import tempfile

from mpidist.launcher import run

__all__ = ["drive"]


def _launched() -> bool:
    return any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def drive(name: str, args, worker, report, worker_args: list[str]) -> int:
    """Run benchmark `name`: worker(args) -> row on every rank of this job, or one job per
    rank count in args.ranks with worker_args; report(rows, args) -> the table's text, printed
    and written with the rows to args.out/NAME.{json,txt}."""
    try:
        import torch  # noqa: F401  (optional: the benchmark needs it, mpidist does not)
    except ImportError:
        print(f"mpidist bench {name} needs PyTorch: pip install 'mpidist[torch]'", file=sys.stderr)
        return 2
    if args.worker or _launched():
        result = worker(args)
        from mpi4py import MPI       # here, not at the top: the driver process starts the ranks
        if MPI.COMM_WORLD.Get_rank() == 0:
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(result, fh, indent=1)
            else:
                print(report([result], args))
        return 0
    rows = []
    for n in [int(r) for r in args.ranks.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result.json")
            argv = [sys.executable, "-m", "mpidist", "bench", name, "--worker", "--json", path,
                    *worker_args]
            proc = run(n, argv, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"the {n}-rank measurement failed (exit {proc.returncode})")
            with open(path) as fh:
                rows.append(json.load(fh))
    text = report(rows, args)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as fh:
        json.dump({"rows": rows, "args": vars(args)}, fh, indent=1)
    with open(os.path.join(args.out, f"{name}.txt"), "w") as fh:
        fh.write(text + "\n")
    print(f"wrote {args.out}/{name}.{{json,txt}}")
    return 0
