"""Imports point down: the graph of mpidist's own imports, read from the source (top level
and inside functions alike), has no cycle; an import inside a function only defers an
optional or heavy dependency, and says so; no module imports another's private names.
No MPI needed."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import mpidist
import mpidist.kernels

ROOT = pathlib.Path(mpidist.__file__).parent
KERNELS = pathlib.Path(mpidist.kernels.__file__).parent     # kernels/, installed as mpidist.kernels

# cycles in areas other work is still untangling; the test fails on any other cycle, and
# on these too once they are broken and come back
KNOWN: list[set[str]] = []


# what an import inside a function may load: optional dependencies, and ones slow to import
# (directly, or through an in-tree module whose top-level imports reach one)
OPTIONAL_OR_SLOW = {"cupy", "cupyx", "numba", "torch", "jax", "matplotlib", "sklearn"}
# what the modules that start rank processes (and the command line every command enters by)
# may defer besides: `from mpi4py import MPI` initialises MPI, which such a process must not
# do, and h5py and NumPy would slow every command down
STARTERS = {"mpidist.cli", "mpidist.launcher", "mpidist.simcluster", "mpidist.bench._driver",
            "mpidist.bench.train", "mpidist.bench.torch", "mpidist.bench.torch_backend",
            "mpidist.bench.torch_tta"}
FOR_STARTERS = {"mpi4py", "h5py", "numpy"}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for package, root in (("mpidist", ROOT), ("mpidist.kernels", KERNELS)):
        for path in root.rglob("*.py"):
            parts = (*package.split("."), *path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _targets(node, package: str, known) -> list[tuple[str, str | None]]:
    """(module, name) pairs an import statement loads: name is None for `import m`, else
    the name taken from m, where that is not itself a module."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    base = node.module or ""
    if node.level:
        up = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        out.append((sub, None) if sub in known else (base, a.name))
    return out


def _package(name: str, path: pathlib.Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _function_imports(tree):
    """The import statements inside function bodies, each once, in order."""
    seen = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in sorted((n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))),
                               key=lambda n: n.lineno):
                if id(node) not in seen:
                    seen.add(id(node))
                    yield node


def _top_level_imports(tree):
    """The import statements that run when the module is imported (not inside functions)."""
    inside = {id(n) for n in _function_imports(tree)}
    return [n for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in inside]


def imports_of(name: str, path: pathlib.Path, known) -> set[str]:
    """The mpidist modules `name` imports anywhere in its source: `from p import m` counts
    as m where m is a module, else as p."""
    package = _package(name, path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(m for m, _ in _targets(node, package, known))
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_parser_sees_imports_inside_functions():
    g = graph()
    assert "mpidist.collectives.core" in g["mpidist.collectives.tuning.timing"]
    assert "mpidist.collectives.select" in g["mpidist.collectives.core"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_cycle_among_the_collectives():
    found = [c for c in cycles(graph()) if any(m.startswith("mpidist.collectives") for m in c)]
    assert not found, f"import cycles: {found}"


def test_the_dispatch_code_does_not_import_the_tuner():
    g = graph()
    for name, deps in g.items():
        if name.startswith("mpidist.collectives") and ".tuning" not in name:
            assert not any(".tuning" in d for d in deps), (name, deps)


def test_no_other_cycle_in_mpidist():
    found = cycles(graph())
    assert all(c in KNOWN for c in found), f"import cycles: {[c for c in found if c not in KNOWN]}"


def folder(module: str) -> str:
    """The folder a module belongs to: its package or top-level module right below mpidist
    (mpidist.engine.loop -> mpidist.engine, mpidist.admm -> mpidist.admm)."""
    return ".".join(module.split(".")[:2])


def folder_graph(g: dict[str, set[str]]) -> dict[str, dict[str, set[tuple[str, str]]]]:
    """{folder: {folder it imports: the module imports that make that edge}}; the package
    mpidist itself, which every module's import loads first, is left out."""
    out: dict[str, dict[str, set[tuple[str, str]]]] = {}
    for name, deps in g.items():
        if name == "mpidist":
            continue
        edges = out.setdefault(folder(name), {})
        for dep in deps:
            if dep != "mpidist" and folder(dep) != folder(name):
                edges.setdefault(folder(dep), set()).add((name, dep))
    return out


def test_folder_graph_names_the_imports_behind_an_edge():
    fg = folder_graph({"mpidist.a.x": {"mpidist.b"}, "mpidist.b": {"mpidist.a.y", "mpidist"},
                       "mpidist.a.y": set(), "mpidist": {"mpidist.b"}})
    assert fg == {"mpidist.a": {"mpidist.b": {("mpidist.a.x", "mpidist.b")}},
                  "mpidist.b": {"mpidist.a": {("mpidist.b", "mpidist.a.y")}}}
    assert cycles({f: set(e) for f, e in fg.items()}) == [{"mpidist.a", "mpidist.b"}]
    ring = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}}
    assert shortest_cycle(ring, "c") == ["a", "b", "c"] and shortest_cycle(ring, "a") == ["a", "b"]


def test_no_cycle_between_folders():
    """The packages and top-level modules of mpidist form layers: counting imports inside
    functions too, no folder imports one that imports it back, however far round."""
    fg = folder_graph(graph())
    g = {f: set(edges) for f, edges in fg.items()}
    report = []
    for comp in cycles(g):
        circles = {tuple(c) for c in (shortest_cycle(g, f) for f in sorted(comp))}
        for circle in sorted(circles, key=len):
            report.append(" -> ".join((*circle, circle[0])))
            for a, b in zip(circle, (*circle[1:], circle[0])):
                report += [f"    {m} -> {d}" for m, d in sorted(fg[a][b])]
    assert not report, "import cycles between folders:\n" + "\n".join(report)


def shortest_cycle(g: dict[str, set[str]], start: str) -> list[str]:
    """A shortest path from start back to itself (breadth first), rotated to begin at its
    least name so that one circle found from each of its members reads the same."""
    back = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g.get(v, ())):
                if w == start:
                    path = [v]
                    while back[path[-1]] is not None:
                        path.append(back[path[-1]])
                    path.reverse()
                    i = path.index(min(path))
                    return path[i:] + path[:i]
                if w not in back:
                    back[w] = v
                    nxt.append(w)
        frontier = nxt
    return []


def _reaching(mods, roots: set[str]) -> set[str]:
    """The in-tree modules whose import loads one of the packages `roots` (at their top
    level, in a package above them, or through another such module)."""
    direct = {}
    for name, path in mods.items():
        deps = set()
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
            deps.update(m for m, _ in _targets(node, _package(name, path), mods))
        parts = name.split(".")
        deps.update(".".join(parts[:i]) for i in range(1, len(parts)))
        direct[name] = deps
    heavy = {n for n, deps in direct.items() if any(d.split(".")[0] in roots for d in deps)}
    grew = True
    while grew:
        grew = False
        for n, deps in direct.items():
            if n not in heavy and deps & heavy:
                heavy.add(n)
                grew = True
    return heavy


def _commented(lines: list[str], lineno: int) -> bool:
    """A comment on the import's line, or above the block of imports it belongs to (then
    it covers the block)."""
    if "#" in lines[lineno - 1]:
        return True
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith(("import ", "from ")):
        if "#" in lines[i]:
            return True
        i -= 1
    return i >= 0 and lines[i].strip().startswith("#")


def _may_defer(importer: str, module: str, slow: set[str], for_starters: set[str]) -> bool:
    if module.split(".")[0] in OPTIONAL_OR_SLOW or module in slow:
        return True
    if importer in STARTERS and (module.split(".")[0] in FOR_STARTERS or module in for_starters):
        return True
    # a benchmark, or the torch integration, loaded only when the command line asks for it
    asked = importer == "mpidist.cli" or importer.startswith("mpidist.bench")
    return asked and module.startswith(("mpidist.bench", "mpidist.torch"))


def test_imports_inside_functions_only_defer_a_heavy_dependency_and_say_so():
    mods = _modules()
    slow = _reaching(mods, OPTIONAL_OR_SLOW)
    for_starters = _reaching(mods, OPTIONAL_OR_SLOW | FOR_STARTERS)
    bad = []
    for name, path in sorted(mods.items()):
        text = path.read_text()
        lines = text.splitlines()
        said = set()            # packages whose deferral a comment explained already
        for node in _function_imports(ast.parse(text, str(path))):
            for module, _ in _targets(node, _package(name, path), mods):
                where = f"{path.relative_to(ROOT.parent)}:{node.lineno} {module}"
                root = module.split(".")[0] if not module.startswith("mpidist") else module
                if not _may_defer(name, module, slow, for_starters):
                    bad.append(f"{where}: move it to the top of the module")
                elif _commented(lines, node.lineno):
                    said.add(root)
                elif root not in said:
                    bad.append(f"{where}: say why it is deferred, in a comment")
    assert not bad, "\n".join(sorted(set(bad)))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_uses_another_modules_private_names():
    """Neither `from m import _x` nor `m._x` for another in-tree module m."""
    mods = _modules()
    bad = []
    for name, path in sorted(mods.items()):
        package = _package(name, path)
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}                     # local name -> the in-tree module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for a, (module, attr) in zip(node.names, _targets(node, package, mods)):
                    if module not in mods or module == name:
                        continue
                    if attr is None and (a.asname or isinstance(node, ast.ImportFrom)):
                        aliases[a.asname or a.name] = module
                    last = attr or module.rpartition(".")[2]
                    # a package's private submodule is for its own modules
                    sibling = attr is None and module.rpartition(".")[0] == package
                    if _private(last) and not sibling:
                        bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} "
                                   f"{module}{'.' + attr if attr else ''}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) \
                    and isinstance(node.value, ast.Name) and node.value.id in aliases:
                bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} "
                           f"{aliases[node.value.id]}.{node.attr}")
    assert not bad, "private names of another module:\n" + "\n".join(bad)


@pytest.mark.launcher
def test_the_command_line_starts_mpi_only_after_its_launch_check():
    """`mpidist CMD` checks for an unwired launch (srun --mpi=none) before MPI_Init, which
    importing mpi4py.MPI performs: importing the command line must not import it."""
    code = "import sys, mpidist.cli; print('mpi4py.MPI' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr
