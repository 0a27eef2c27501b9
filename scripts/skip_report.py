"""The suite's skips, grouped by reason, and whether any of them should not have happened.

    python scripts/skip_report.py RESULTS_DIR --installed torch,jax,ft,netns

Reads the JUnit reports that scripts/test.sh collects (one per run), prints the skips grouped
by reason with their count and the total, and exits 1 when a skip belongs to a component
that the set-up installed on this machine (its tests then silently stopped testing it).
Skips for what this machine lacks (a GPU, more ranks than the run has) are expected.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter

# a component -> what its tests' skip reasons say when it is missing
COMPONENTS = {
    "torch": re.compile(r"\btorch\b|pytorch", re.I),
    "jax": re.compile(r"\bjax\b", re.I),
    "ft": re.compile(r"\bFT environment\b|ULFM|MPIDIST_FT_VENV", re.I),
    "netns": re.compile(r"network namespace|simulated cluster", re.I),
}


def reasons(paths: list[str]) -> Counter:
    """Skip reason -> how many tests skipped with it, over the JUnit files in paths."""
    out: Counter = Counter()
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            for skipped in case.findall("skipped"):
                out[_reason(skipped.get("message") or skipped.text or "")] += 1
    return out


def _reason(message: str) -> str:
    """pytest's message without its 'file:line: ' prefix, which varies per test."""
    return re.sub(r"^\S+:\d+: ", "", message.strip()).strip() or "(no reason given)"


def unexpected(counts: Counter, installed: set[str]) -> dict[str, list[str]]:
    """For each installed component, the skip reasons that say it is missing."""
    bad: dict[str, list[str]] = {}
    for reason in counts:
        for name in installed:
            if COMPONENTS[name].search(reason):
                bad.setdefault(name, []).append(reason)
    return bad


def report(counts: Counter, bad: dict[str, list[str]]) -> str:
    lines = [f"skipped: {sum(counts.values())} in all, by reason"]
    for reason, n in counts.most_common():
        lines.append(f"  {n:>6}  {reason}")
    for name, rs in sorted(bad.items()):
        lines.append(f"!!! {name} is installed here, yet {sum(counts[r] for r in rs)} test(s) "
                     f"skipped for want of it: " + "; ".join(rs))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", help="directory of JUnit XML files")
    parser.add_argument("--installed", default="",
                        help="components installed here: " + ",".join(COMPONENTS))
    args = parser.parse_args(argv)
    installed = {c.strip() for c in args.installed.split(",") if c.strip()}
    unknown = installed - set(COMPONENTS)
    if unknown:
        parser.error(f"unknown component(s) {sorted(unknown)}; known: {', '.join(COMPONENTS)}")
    counts = reasons(sorted(glob.glob(os.path.join(args.results, "*.xml"))))
    bad = unexpected(counts, installed)
    print(report(counts, bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
