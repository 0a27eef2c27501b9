"""The experiments' shape and their models, without MPI: every module stays under 400
lines, a package's modules import one another without a cycle, and the analytic models
give the figures their docstrings state."""
import ast
import math
import os

import pytest

from experiments.architectures import model as arch_model
from experiments.centralized.model import model_reduction
from experiments.large_batch.model import largest_stable, scaled_lr

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "experiments")
PACKAGES = ("architectures", "centralized", "consistency", "large_batch", "compression")


def _modules():
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(folder, f)


def test_no_module_over_400_lines():
    long = {os.path.relpath(p, ROOT): n for p in _modules()
            if (n := sum(1 for _ in open(p))) > 400}
    assert not long, long


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_form_no_cycle(package):
    folder = os.path.join(ROOT, package)
    names = {f[:-3] for f in os.listdir(folder) if f.endswith(".py")} - {"__init__", "__main__"}
    deps = {}
    for name in names:
        tree = ast.parse(open(os.path.join(folder, name + ".py")).read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == f"experiments.{package}":
                    found |= {a.name for a in node.names if a.name in names}
                elif node.module.startswith(f"experiments.{package}."):
                    found.add(node.module.rsplit(".", 1)[1])
        deps[name] = found
    done, stack = set(), []

    def visit(n):
        assert n not in stack, f"import cycle in experiments.{package}: {stack + [n]}"
        if n in done:
            return
        stack.append(n)
        for d in deps[n]:
            visit(d)
        stack.pop()
        done.add(n)

    for n in sorted(names):
        visit(n)
    assert "driver" in names and not any("driver" in d for d in deps.values())


@pytest.mark.parametrize("p", [2, 3, 4, 7])
def test_ring_moves_2_p_minus_1_over_p_and_one_server_p(p):
    n = 1.0
    assert math.isclose(arch_model.link_bytes("ring", p, n), 2 * (p - 1) / p)
    assert math.isclose(arch_model.link_bytes("p2p", p, n), 2 * (p - 1) / p)
    assert math.isclose(arch_model.link_bytes("ps", p, n), p)
    assert math.isclose(arch_model.link_bytes("ps", p, n, servers=2), max(p / 2, 1))
    # the PS's push and pull follow each other; the ring's directions overlap
    assert math.isclose(arch_model.link_seconds("ps", p, n, rate=1.0), 2 * p)
    assert math.isclose(arch_model.link_seconds("ring", p, n, rate=1.0), 2 * (p - 1) / p)
    with pytest.raises(ValueError, match="valid"):
        arch_model.link_bytes("tree", p, n)


def test_hierarchical_sends_fewer_bytes_per_node_than_the_flat_ring():
    for nodes, per_node in ((2, 2), (3, 2), (4, 8)):
        flat = arch_model.node_bytes("ring", nodes, per_node, 1.0)
        hier = arch_model.node_bytes("hierarchical", nodes, per_node, 1.0)
        assert math.isclose(hier, 2 * (nodes - 1) / nodes) and hier < flat
    assert arch_model.node_bytes("native", 2, 2, 1.0) is None


def test_the_bandwidth_model_saves_75_percent_at_two_workers_and_more_beyond():
    assert math.isclose(model_reduction(2), 0.75)
    assert model_reduction(2) < model_reduction(3) < model_reduction(4)
    assert math.isclose(model_reduction(4), 1 - 3 / 16)


def test_learning_rate_rules_and_the_stable_band():
    assert math.isclose(scaled_lr("sgd", 64), 2 * scaled_lr("sgd", 32))      # linear
    assert math.isclose(scaled_lr("lamb", 4096), 2 * scaled_lr("lamb", 1024))  # sqrt
    rows = [{"optimizer": o, "batch": b, "test_accuracy": acc, "diverged": False}
            for o in ("sgd", "lars", "lamb", "adamw")
            for b, acc in ((256, 0.80), (4096, 0.79 if o != "sgd" else 0.10))]
    ref, stable = largest_stable(rows)
    assert ref == 0.80 and stable["sgd"] == 256 and stable["lamb"] == 4096
