"""Sizes the house keeps: no module of mpidist/, kernels/ or experiments/ over 400 lines (one
concept per module, readable top to bottom), and docs/PERFORMANCE.md at most 200 lines (the
current figures with their commands, not a diary). No MPI needed."""
from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODULE_LINES, PERFORMANCE_LINES = 400, 200


def lines(path: pathlib.Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_is_over_400_lines():
    over = {str(p.relative_to(ROOT)): lines(p)
            for folder in ("mpidist", "kernels", "experiments")
            for p in sorted((ROOT / folder).rglob("*.py")) if lines(p) > MODULE_LINES}
    assert not over, f"modules over {MODULE_LINES} lines (split them by concept): {over}"


def test_the_performance_page_holds_current_figures_only():
    n = lines(ROOT / "docs" / "PERFORMANCE.md")
    assert n <= PERFORMANCE_LINES, f"docs/PERFORMANCE.md has {n} lines, at most {PERFORMANCE_LINES}"
