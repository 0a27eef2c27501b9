"""Rank-prefixed logging and the per-step metrics file (JSON lines, written by rank 0)."""
from __future__ import annotations

import json
import logging
import math
import os
import sys

from tqdm import tqdm

__all__ = ["setup_logging", "MetricsWriter", "read_metrics"]


class _AboveTheBar(logging.StreamHandler):
    """Writes each record through tqdm, which clears a live progress bar, prints the line
    and draws the bar again below it (a plain write would cut through the bar)."""

    def emit(self, record) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:             # as logging's own handlers: never raise from a log call
            self.handleError(record)


def setup_logging(rank: int, size: int, level: int = logging.INFO) -> logging.Logger:
    """The 'mpidist' logger, every line prefixed with [rank r/size], printed above a
    progress bar where one is shown."""
    log = logging.getLogger("mpidist")
    log.handlers.clear()
    handler = _AboveTheBar(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}/{size}] %(asctime)s %(levelname)s %(message)s",
                                           datefmt="%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False
    return log


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):
        return _clean(v.item())
    return v


class MetricsWriter:
    """Appends one JSON object per record to <out_dir>/metrics.jsonl (rank 0 only; no-op elsewhere)."""

    def __init__(self, path: str, active: bool, append: bool = False):
        self.path = path
        self.fh = None
        if active:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.fh = open(path, "a" if append else "w", buffering=1)

    def write(self, record: dict) -> None:
        if self.fh is not None:
            self.fh.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


def read_metrics(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
