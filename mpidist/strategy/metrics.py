"""Rank-prefixed logging and the per-step metrics file (JSON lines, written by rank 0)."""
from __future__ import annotations

import json
import logging
import math
import os
import sys

from tqdm import tqdm

__all__ = ["setup_logging", "MetricsWriter", "read_metrics", "append_step_if_missing"]


class _AboveTheBar(logging.StreamHandler):
    """Writes each record with tqdm's live progress bars cleared first and drawn again
    below it (a plain write would cut through the bar)."""

    def emit(self, record) -> None:
        # the line itself in one write, as StreamHandler does (ranks share the stream: two
        # writes per line would interleave with the other ranks' lines)
        with tqdm.external_write_mode(file=self.stream):
            super().emit(record)


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


def append_step_if_missing(path: str, record: dict) -> None:
    """Append a step's metrics line to the file at path unless its tail already has that step.

    After a lost rank 0 the new rank 0 writes the newest completed step's line, which the
    old one may or may not have written before it died; the file's last 64 KiB decide."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - (1 << 16)))
            tail = fh.read().decode(errors="replace")
    except OSError:
        tail = ""
    if f'"event": "step", "step": {record["step"]},' not in tail:
        writer = MetricsWriter(path, True, append=True)
        writer.write(record)
        writer.close()
