"""The folders of mpidist (its packages and top-level modules) stand in layers, and every
import points down or across, never up: a folder may import one in its own layer or below.
The layers are data, read bottom first; a new folder must be given a layer here.
No MPI needed."""
from __future__ import annotations

from tests.test_imports import folder_graph, graph

# bottom first; each a set of folders right below mpidist
LAYERS: list[set[str]] = [
    # no MPI communication: errors, sizes and the partition, the MPI library and its
    # environment, threads, the array kernels, HDF5, starting processes
    {"errors", "sizes", "partition", "checks", "backoff", "mpienv", "mpilib", "threads",
     "kernels", "h5", "launcher", "simcluster"},
    # the Communicator (topology, sub-communicators) and ULFM's detect / revoke / shrink
    {"comm", "ulfm"},
    # the allreduce algorithms, their selection and tuning, the mismatch guard
    {"collectives"},
    # building blocks over flat buffers: compression, optimizers, layers, data, the state
    # types and the checkpoints that write them
    {"compress", "optim", "flat", "nn", "data", "state", "checkpoint"},
    # the Strategy base, its builders and metrics
    {"strategy"},
    # the strategies and what runs beside them
    {"zero", "ps", "pipeline", "admm", "diloco", "ft"},
    # the training loop, config and job
    {"engine"},
    # the PyTorch bridge
    {"torch"},
    # what a user starts: benchmarks, the command line, the doctor
    {"bench", "cli", "doctor", "__main__"},
]


def layer_of(layers: list[set[str]]) -> dict[str, int]:
    """{folder: its layer's index, 0 at the bottom}; a folder in two layers is an error."""
    out: dict[str, int] = {}
    for i, names in enumerate(layers):
        for name in names:
            if name in out:
                raise ValueError(f"{name} is in layers {out[name]} and {i}")
            out[name] = i
    return out


def upward(fg: dict[str, dict[str, set[tuple[str, str]]]], layers: list[set[str]]) -> list[str]:
    """What breaks the layering in a folder graph (mpidist.NAME keys, as folder_graph makes):
    a folder in no layer, and each import from a folder to one in a higher layer, named by
    the module imports that make it."""
    level = layer_of(layers)
    short = {f: f.removeprefix("mpidist.") for f in fg}
    named = set(short.values()) | {d.removeprefix("mpidist.") for edges in fg.values() for d in edges}
    report = [f"{f}: in no layer; add it to LAYERS" for f in sorted(named - set(level))]
    for f, edges in sorted(fg.items()):
        for dep, imports in sorted(edges.items()):
            a, b = short[f], dep.removeprefix("mpidist.")
            if a in level and b in level and level[b] > level[a]:
                report.append(f"{a} (layer {level[a]}) imports {b} (layer {level[b]}):")
                report += [f"    {m} -> {d}" for m, d in sorted(imports)]
    return report


def test_the_checker_finds_an_upward_import_and_a_folder_in_no_layer():
    layers = [{"low"}, {"mid", "side"}, {"high"}]
    fine = {"mpidist.high": {"mpidist.mid": {("mpidist.high.a", "mpidist.mid")}},
            "mpidist.mid": {"mpidist.low": {("mpidist.mid", "mpidist.low.b")},
                            "mpidist.side": {("mpidist.mid", "mpidist.side")}},
            "mpidist.side": {"mpidist.mid": {("mpidist.side", "mpidist.mid")}},
            "mpidist.low": {}}
    assert upward(fine, layers) == []
    bad = {**fine, "mpidist.low": {"mpidist.high": {("mpidist.low.b", "mpidist.high.a")}},
           "mpidist.new": {}}
    assert upward(bad, layers) == ["new: in no layer; add it to LAYERS",
                                   "low (layer 0) imports high (layer 2):",
                                   "    mpidist.low.b -> mpidist.high.a"]
    try:
        layer_of([{"a"}, {"a"}])
    except ValueError as exc:
        assert "a is in layers 0 and 1" in str(exc)
    else:
        raise AssertionError("a folder in two layers was accepted")


def test_every_folder_has_a_layer_and_imports_only_down_or_across():
    """Counting imports inside functions too; the fix for a failure is to move the imported
    code down (or the importing code up), not to move a folder between layers."""
    fg = folder_graph(graph())
    report = upward(fg, LAYERS)
    gone = set().union(*LAYERS) - {f.removeprefix("mpidist.") for f in fg}
    report += [f"{name}: in LAYERS but not in mpidist; remove it" for name in sorted(gone)]
    assert not report, "imports against the layers:\n" + "\n".join(report)
