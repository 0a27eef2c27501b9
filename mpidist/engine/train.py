"""`mpidist train CONFIG` (also `python -m mpidist train CONFIG`): run a job from a TOML file.

    mpiexec -n 4 mpidist train jobs/digits_lamb.toml
    mpiexec -n 4 mpidist train jobs/digits_lamb.toml --set job.epochs=5 --set parallel.algorithm='"tree"'
    srun -n 4 mpidist train jobs/digits_lamb.toml

Rank 0 validates the whole config first and broadcasts the verdict: a bad config prints the
same message on every rank and exits with status 2 before any rank does work.
"""
from __future__ import annotations

import argparse
import sys
import tomllib
import traceback

from mpidist.comm import Communicator
from mpidist.engine.config import format_schema, load_config
from mpidist.engine.loop import JobFailed, run
from mpidist.errors import ConfigError, abort_job
from mpidist.strategy.metrics import setup_logging
from mpidist.ulfm import exit_now

__all__ = ["main"]


def parse_override(text: str) -> tuple[str, object]:
    """(key, value) of one --set section.key=VALUE (a TOML value, or a bare word)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ValueError(f"--set takes section.key=VALUE (a TOML value), got {text!r}")
    key, value = text.split("=", 1)
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value                      # a bare word is taken as a string
    return key.strip(), parsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpidist train", description="train a model from a TOML job config")
    parser.add_argument("config", nargs="?", help="the job's TOML file (see jobs/)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable), e.g. --set job.epochs=3")
    parser.add_argument("--out", metavar="DIR", help="output directory (same as --set job.out_dir=DIR)")
    parser.add_argument("--resume", action="store_true",
                        help="resume from the latest checkpoint (same as --set checkpoint.resume=true)")
    parser.add_argument("--show-schema", action="store_true", help="print every section and key, then exit")
    args = parser.parse_args(argv)
    if args.show_schema:
        print(format_schema())
        return 0
    if not args.config:
        parser.error("give a CONFIG file (or --show-schema)")

    comm = Communicator()
    log = setup_logging(comm.rank, comm.size)
    try:
        overrides = dict(parse_override(s) for s in args.set)
    except ValueError as exc:
        log.error("mpidist train: %s", exc)
        return 2
    if args.out:
        overrides["job.out_dir"] = args.out
    if args.resume:
        overrides["checkpoint.resume"] = True
    try:
        config = load_config(args.config, comm, overrides)
        summary = run(config, comm)
    except ConfigError as exc:
        log.error("mpidist train: %s", exc)
        return 2
    except JobFailed as exc:
        log.error("mpidist train: job failed: %s", exc)
        return 1
    except Exception:
        # not agreed across ranks: the others may be waiting in a collective, so end them all
        log.error("mpidist train: unexpected error, aborting the job\n%s", traceback.format_exc())
        abort_job(comm, 1)
    target = config["job"]["target_accuracy"]
    code = 0
    if target and summary["test_accuracy"] < target:
        log.error("test accuracy %.4f is below job.target_accuracy = %.4f", summary["test_accuracy"], target)
        code = 1
    else:
        comm.free()
    if summary.get("recoveries"):         # a rank was lost: MPI_Finalize may hang (mpidist.ft)
        exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
