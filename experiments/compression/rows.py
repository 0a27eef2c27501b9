"""The MPI job's result as table rows, and a run's accuracy curve from its metrics."""
from __future__ import annotations

import json
import os

from experiments.compression.compressors import COMPRESSORS


def table_rows(res: dict) -> list[dict]:
    """One row per compressor that ran: bytes per step and per run, against the float32
    ring's, and the final accuracy."""
    dense = res["bytes"][COMPRESSORS[0][0]]
    rows = []
    for label, _, opts in COMPRESSORS:
        if label not in res["runs"]:
            continue
        r, b = res["runs"][label], res["bytes"][label]
        rows.append({"compressor": label, "options": json.dumps(opts), "bytes_per_step": b,
                     "wire_ratio": b / dense, "steps": r["steps"],
                     "MB_sent_per_rank": b * r["steps"] / 1e6,
                     "test_accuracy": r["test_accuracy"], "test_loss": r["test_loss"],
                     "train_s": r["train_s"]})
    return rows


def curve(path: str) -> tuple[list, list]:
    """(steps, test accuracies) at each evaluation of the run in `path`."""
    steps, accs = [], []
    with open(os.path.join(path, "metrics.jsonl")) as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("event") == "eval":
                steps.append(rec["step"])
                accs.append(rec["accuracy"])
    return steps, accs
