"""What every experiment shares: its command line, where its files go, starting its ranks
(on the simulated cluster or with the launcher), reading their results, and writing its
CSV, plot and section of docs/EXPERIMENTS.md."""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "EXPERIMENTS.md")
FIGURES = os.path.join(REPO, "docs", "experiments")
RESULT = "RESULT "                 # the line a worker's rank 0 prints its JSON after


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m experiments.{name}",
                                description=doc.strip().splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="a small run (under 2 minutes) into results/experiments/NAME-quick")
    p.add_argument("--out", default=None,
                   help="directory for the CSV, PNG and section (default: docs/experiments, "
                        "or results/experiments/NAME-quick with --quick)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # set inside the job
    return p


class Outputs:
    """Where an experiment's files go: a full run updates docs/, --quick or --out do not."""

    def __init__(self, name: str, args):
        self.name = name
        self.full = not args.quick and args.out is None
        self.dir = args.out or (os.path.join(REPO, "results", "experiments", f"{name}-quick")
                                if args.quick else FIGURES)
        os.makedirs(self.dir, exist_ok=True)
        self.csv = os.path.join(self.dir, f"{name}.csv")
        self.png = os.path.join(self.dir, f"{name}.png")
        self.section = os.path.join(self.dir, f"{name}.md")

    def write_csv(self, rows: list[dict]) -> None:
        fields: list[str] = []
        for r in rows:
            fields += [k for k in r if k not in fields]
        with open(self.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=fields)
            w.writeheader()
            w.writerows({k: _fmt(v) for k, v in r.items()} for r in rows)

    def write_section(self, text: str) -> None:
        """Into docs/EXPERIMENTS.md on a full run, else into NAME.md beside the CSV."""
        text = text.strip() + "\n"
        if self.full:
            replace_section(DOC, self.name, text)
        else:
            with open(self.section, "w") as fh:
                fh.write(text)
        print(f"wrote {self.csv}, {self.png} and "
              + (f"its section of {os.path.relpath(DOC, REPO)}" if self.full else self.section))

    def figure_link(self) -> str:
        """The plot as the section links it (relative to docs/ on a full run)."""
        return f"experiments/{self.name}.png" if self.full else self.png


def _fmt(v):
    return f"{v:.6g}" if isinstance(v, float) else v


def replace_section(path: str, name: str, text: str) -> None:
    """Put `text` between this experiment's markers in the document (appended if absent)."""
    begin, end = f"<!-- experiment: {name} -->", f"<!-- /experiment: {name} -->"
    block = f"{begin}\n{text}{end}\n"
    doc = open(path).read() if os.path.exists(path) else "# Experiments\n\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    doc = pattern.sub(lambda _: block, doc) if pattern.search(doc) else doc.rstrip() + "\n\n" + block
    with open(path, "w") as fh:
        fh.write(doc)


def machine() -> str:
    """One line on where the figures were taken (the load says how shared it was)."""
    load = os.getloadavg()
    return (f"{platform.node() or 'this machine'}: {os.cpu_count()} cores shared with other "
            f"jobs (load average {load[0]:.1f} at the end of the run), "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def command_line(name: str, args) -> str:
    return f"python -m experiments.{name}" + (" --quick" if args.quick else "")


def costmodel():
    """The alpha-beta cost model (experiments.costmodel), imported when an experiment needs
    it (it starts MPI)."""
    from experiments import costmodel as module
    return module


# ---------------------------------------------------------------------- starting ranks
def worker_argv(name: str, worker_args: list[str]) -> list[str]:
    return [sys.executable, "-m", f"experiments.{name}", "--worker", *worker_args]


def parse_result(proc: subprocess.CompletedProcess, what: str) -> dict:
    """The JSON rank 0 printed after RESULT; RuntimeError with the job's output tail else."""
    out = proc.stdout or ""
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = (out[-2000:] + "\n" + (proc.stderr or "")[-3000:]).strip()
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len(RESULT):])


def run_local(name: str, n: int, worker_args: list[str], timeout: float, what: str) -> dict:
    """Start the experiment's worker on n local ranks (mpidist.launcher.run)."""
    from mpidist.launcher import run
    proc = run(n, worker_argv(name, worker_args), timeout=timeout, capture_output=True,
               text=True, cwd=REPO)
    return parse_result(proc, what)


def run_cluster(name: str, cluster, worker_args: list[str], timeout: float, what: str,
                np: int | None = None, thread_level: str | None = None) -> dict:
    """Start the experiment's worker on the simulated cluster's ranks."""
    proc = cluster.run(worker_argv(name, worker_args), np=np, timeout=timeout,
                       thread_level=thread_level, capture_output=True, text=True, cwd=REPO)
    return parse_result(proc, what)


def need_cluster() -> None:
    """Exit with the reason where no simulated cluster can be made (not root, no iproute2)."""
    from mpidist.simcluster import unavailable_reason
    reason = unavailable_reason()
    if reason is not None:
        sys.exit(f"this experiment runs on the simulated cluster, which cannot be made "
                 f"here: {reason}")


def emit(result: dict) -> None:
    """Rank 0 of a worker job: print the result line the driver reads."""
    print(RESULT + json.dumps(result), flush=True)


def train_summary(out_dir: str) -> tuple[dict, list[dict]]:
    """summary.json and metrics.jsonl of a `mpidist train` run."""
    with open(os.path.join(out_dir, "summary.json")) as fh:
        summary = json.load(fh)
    records = []
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        for line in fh:
            if line.strip():
                records.append(json.loads(line))
    return summary, records


def toml_value(v) -> str:
    """A Python value as a TOML value (for `mpidist train --set`)."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return json.dumps(v)


def _launch(n: int, argv: list[str], timeout: float, cluster, thread_level: str | None):
    """argv on n ranks, locally through mpidist's launcher or on the cluster's first n
    ranks; its output captured."""
    if cluster is None:
        from mpidist.launcher import run
        return run(n, argv, timeout=timeout, capture_output=True, text=True, cwd=REPO)
    return cluster.run(argv, np=n, timeout=timeout, thread_level=thread_level,
                       capture_output=True, text=True, cwd=REPO)


def mpidist_train(n: int, config: str, overrides: dict, out_dir: str, timeout: float,
                  cluster=None, thread_level: str | None = None) -> tuple[dict, list[dict]]:
    """Run `mpidist train CONFIG --set k=v ...` on n ranks (locally, or on the cluster's
    first n ranks); returns its summary and metrics records."""
    sets = []
    for k, v in {"job.progress": False, "job.plot": False, **overrides}.items():
        sets += ["--set", f"{k}={toml_value(v)}"]
    argv = [sys.executable, "-m", "mpidist", "train", os.path.join(REPO, config),
            "--out", out_dir, *sets]
    proc = _launch(n, argv, timeout, cluster, thread_level)
    if proc.returncode != 0:
        raise RuntimeError(f"mpidist train {config} {' '.join(sets)} failed (exit "
                           f"{proc.returncode}):\n{(proc.stderr or '')[-3000:]}")
    return train_summary(out_dir)


def train_many(n: int, runs: list[tuple[str, dict, str]], timeout: float, tmp: str,
               cluster=None, thread_level: str | None = None) -> list[tuple[dict, list[dict]]]:
    """Several `mpidist train` runs in one MPI job (imports and compiled kernels shared):
    runs = [(config path, {section.key: value}, out_dir)]; returns (summary, metrics) each."""
    spec = os.path.join(tmp, f"train-many-{len(os.listdir(tmp))}.json")
    with open(spec, "w") as fh:
        json.dump([[os.path.join(REPO, c), {"job.progress": False, "job.plot": False, **o,
                                            "job.out_dir": d}] for c, o, d in runs], fh)
    argv = [sys.executable, "-m", "experiments.common", spec]
    proc = _launch(n, argv, timeout, cluster, thread_level)
    if proc.returncode != 0:
        raise RuntimeError(f"training runs of {spec} failed (exit {proc.returncode}):\n"
                           f"{(proc.stderr or '')[-4000:]}")
    return [train_summary(d) for _, _, d in runs]


def _train_worker(spec_path: str) -> int:
    """Inside the MPI job: run every (config, overrides) of the spec, one after another."""
    from mpidist.comm import Communicator
    from mpidist.engine.config import load_config
    from mpidist.engine.loop import run
    with open(spec_path) as fh:
        spec = json.load(fh)
    comm = Communicator()
    for config_path, overrides in spec:
        run(load_config(config_path, comm, overrides), comm)
    comm.free()
    return 0


if __name__ == "__main__":
    sys.exit(_train_worker(sys.argv[1]))
