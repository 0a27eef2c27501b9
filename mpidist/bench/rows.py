"""How a benchmark leaves its figures: its rows as NAME.csv, and as NAME.json beside what
it ran with (arguments, ranks, machine), in its output directory."""
from __future__ import annotations

import csv
import json
import os

__all__ = ["write_rows"]


def write_rows(out: str, name: str, rows: list[dict], meta: dict) -> str:
    """Write out/NAME.csv (one line per row, the first row's keys as header) and
    out/NAME.json ({**meta, "rows": rows}); returns out/NAME, for the caller's plot."""
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, name)
    with open(base + ".csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(base + ".json", "w") as fh:
        json.dump({**meta, "rows": rows}, fh, indent=1)
    return base
