"""scripts/skip_report.py: skips grouped by reason, and a non-zero exit when a component the
set-up installed produced skips (the check scripts/test.sh ends with)."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("skip_report",
                                               os.path.join(ROOT, "scripts", "skip_report.py"))
skip_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(skip_report)


def _junit(path, skips):
    cases = "".join(f'<testcase name="t{i}"><skipped message="{m}"/></testcase>'
                    for i, m in enumerate(skips))
    path.write_text(f'<testsuites><testsuite tests="{len(skips) + 1}">{cases}'
                    f'<testcase name="ok"/></testsuite></testsuites>')


def test_skips_grouped_by_reason_without_the_file_prefix(tmp_path, capsys):
    _junit(tmp_path / "n1.xml", ["tests/a.py:3: needs CuPy and a CUDA GPU",
                                 "tests/b.py:9: needs CuPy and a CUDA GPU",
                                 "tests/c.py:1: needs at least 2 MPI ranks (running on 1)"])
    _junit(tmp_path / "n2.xml", ["tests/a.py:3: needs CuPy and a CUDA GPU"])
    assert skip_report.main([str(tmp_path), "--installed", "torch,jax"]) == 0
    out = capsys.readouterr().out
    assert "skipped: 4 in all" in out
    assert "     3  needs CuPy and a CUDA GPU" in out


@pytest.mark.parametrize("component,reason", [
    ("torch", "tests/torch/x.py:1: could not import 'torch': No module named 'torch'"),
    ("jax", "tests/x.py:2: needs JAX"),
    ("ft", "tests/ft/t.py:3: the FT environment did not build"),
    ("netns", "tests/s.py:4: creating network namespaces needs root"),
])
def test_an_installed_component_that_skipped_fails_the_run(tmp_path, capsys, component, reason):
    _junit(tmp_path / "n1.xml", [reason])
    assert skip_report.main([str(tmp_path), "--installed", component]) == 1
    assert f"!!! {component} is installed here" in capsys.readouterr().out
    others = ",".join(c for c in skip_report.COMPONENTS if c != component)
    assert skip_report.main([str(tmp_path), "--installed", others]) == 0


def test_unknown_component_is_an_error(tmp_path):
    with pytest.raises(SystemExit):
        skip_report.main([str(tmp_path), "--installed", "cuda"])
