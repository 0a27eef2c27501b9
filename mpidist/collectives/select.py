"""algorithm="auto": a lookup in a decision table, or a short built-in rule without one.

The table (written by `mpidist tune`, a JSON file readable and editable by hand; its format
is in Table's docstring) maps a communicator layout and a message size to an algorithm. The
table in use is use_table()'s ([parallel] algorithm_table in a job), else env
MPIDIST_ALGORITHM_TABLE (read at the first auto call), else none. Without one, or for a
layout it does not list, `rule` decides. `choose` is pure: no probe and no timing run inside
a call, and processes with the same table run the same algorithm, hence produce the same
bits. Under fault tolerance (ULFM) `shm` is never chosen (a table's `shm` gives way to the
rule). See docs/BENCHMARKS.md (tuning auto) and docs/ARCHITECTURE.md (collectives).
"""
from __future__ import annotations

import bisect
import json
import os
import sys
import threading

from mpidist.collectives import node, shm
from mpidist.collectives.registry import ALGORITHMS
from mpidist.sizes import format_size, parse_size

__all__ = ["choose", "rule", "use_table", "table_path", "load_table", "layout_of", "describe",
           "Table", "FORMAT", "ENV_TABLE", "SMALL_BYTES"]

FORMAT = "mpidist allreduce table 1"
ENV_TABLE = "MPIDIST_ALGORITHM_TABLE"
# Below this many bytes a message is latency-bound: the MPI library's own collective, one C
# call with no Python per step, pays the least fixed cost. From here on the algorithms that
# move 2(p-1)/p of the bytes per rank win; it is also shm's block, one block per rank.
SMALL_BYTES = 256 << 10


def rule(comm, nbytes: int) -> str:
    """The built-in choice: native for small messages (and one rank), then shm within one
    node of three or more ranks where usable, hierarchical on uniform multi-node layouts,
    ring otherwise. (Two ranks take the ring: one exchange each way, which shm's copies in
    and out of the window cannot beat.)"""
    if comm.size == 1 or nbytes <= SMALL_BYTES:
        return "native"
    if shm.preferred(comm):
        return "shm"
    if comm.num_nodes > 1 and comm.uniform_nodes and comm.local_size > 1:
        return "hierarchical"
    return "ring"


def layout_of(comm) -> dict:
    """comm's layout as a table entry names it: ranks, nodes, ranks_per_node (an int on
    uniform nodes, else the list of node sizes)."""
    per_node = comm.local_size if comm.uniform_nodes else list(comm.node_sizes)
    return {"ranks": comm.size, "nodes": comm.num_nodes, "ranks_per_node": per_node}


def _key(layout: dict) -> tuple:
    per_node = layout["ranks_per_node"]
    return layout["ranks"], layout["nodes"], tuple(per_node) if isinstance(per_node, list) \
        else per_node


class Table:
    """A checked decision table: layout -> (inclusive upper ends, algorithms).

    The table is a JSON file (written by `mpidist tune`, readable and editable by hand) that
    lists, per communicator layout (ranks, nodes, ranks per node), the algorithm for each
    range of message sizes, in bytes reduced (half precision counts at its float32 width):

        {"format": "mpidist allreduce table 1",
         "layouts": [{"ranks": 4, "nodes": 1, "ranks_per_node": 4,
                      "sizes": [{"upto": "64K", "algorithm": "native"},
                                {"upto": null, "algorithm": "shm"}]}]}

    A size goes to the first row whose `upto` (inclusive) holds it; past the last `upto`, the
    last row. Other keys (the tuner's measurements) are notes: kept with the entry, never
    read by choose().
    """

    def __init__(self, data, path: str = "<table>"):
        """ValueError naming the file and the entry for anything malformed."""
        self.path = path
        self.steps: dict[tuple, tuple[tuple[int, ...], tuple[str, ...]]] = {}
        self.entries: dict[tuple, dict] = {}        # the layouts as written, notes included

        def bad(what: str) -> ValueError:
            return ValueError(f"allreduce algorithm table {path}: {what}; fix the file or "
                              f"write it again with `mpidist tune --out {path}`")
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise bad(f"not a table (expected a JSON object with \"format\": \"{FORMAT}\")")
        layouts = data.get("layouts")
        if not isinstance(layouts, list):
            raise bad("\"layouts\" must be a list")
        for i, entry in enumerate(layouts):
            where = f"layouts[{i}]"
            if not isinstance(entry, dict):
                raise bad(f"{where} must be an object")
            for k in ("ranks", "nodes"):
                if not isinstance(entry.get(k), int) or entry[k] < 1:
                    raise bad(f"{where}.{k} must be a positive integer, got {entry.get(k)!r}")
            per_node = entry.get("ranks_per_node")
            ok = (isinstance(per_node, int) and per_node >= 1) or (
                isinstance(per_node, list) and per_node and
                all(isinstance(n, int) and n >= 1 for n in per_node))
            if not ok:
                raise bad(f"{where}.ranks_per_node must be a positive integer or a list of "
                          f"node sizes, got {per_node!r}")
            rows = entry.get("sizes")
            if not isinstance(rows, list) or not rows:
                raise bad(f"{where}.sizes must be a non-empty list of "
                          f"{{\"upto\": size, \"algorithm\": name}}")
            ends, names = [], []
            for j, row in enumerate(rows):
                at = f"{where}.sizes[{j}]"
                if not isinstance(row, dict):
                    raise bad(f"{at} must be an object")
                name = row.get("algorithm")
                if name not in ALGORITHMS:
                    raise bad(f"{at}.algorithm = {name!r} is not one of {', '.join(ALGORITHMS)}")
                upto = row.get("upto")
                if upto is None:
                    if j != len(rows) - 1:
                        raise bad(f"{at}.upto is null but only the last row may be open-ended")
                    end = -1
                else:
                    try:
                        end = parse_size(upto)
                    except Exception:
                        raise bad(f"{at}.upto = {upto!r} is not a size (512, \"64K\", \"1M\")") \
                            from None
                    if ends and end <= ends[-1]:
                        raise bad(f"{at}.upto = {upto!r} does not grow from the row before")
                ends.append(end)
                names.append(name)
            if ends[-1] == -1:
                ends[-1] = 1 << 62
            key = _key(entry)
            if key in self.steps:
                raise bad(f"{where} repeats the layout {key}")
            self.steps[key] = (tuple(ends), tuple(names))
            self.entries[key] = entry

    def entry(self, layout: dict) -> dict | None:
        """The table's entry for layout (layout_of's form) as written, or None."""
        return self.entries.get(_key(layout))

    def row(self, layout: dict, nbytes: int) -> tuple[int, int, str] | None:
        """(index, inclusive upper end, algorithm) of layout's row that holds nbytes (past
        the last end: the last row; an open end is 1 << 62), or None for an unlisted layout."""
        found = self.steps.get(_key(layout))
        if found is None:
            return None
        ends, names = found
        i = min(bisect.bisect_left(ends, nbytes), len(names) - 1)
        return i, ends[i], names[i]


def load_table(path: str) -> Table:
    """Read and check the table at path (ValueError saying what is wrong)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"allreduce algorithm table {path}: cannot read it ({exc.strerror}); "
                         f"check [parallel] algorithm_table / {ENV_TABLE}, or write one with "
                         f"`mpidist tune --out {path}`") from None
    except ValueError as exc:
        raise ValueError(f"allreduce algorithm table {path}: not valid JSON ({exc}); fix the "
                         f"file or write it again with `mpidist tune --out {path}`") from None
    return Table(data, path)


_UNREAD = object()
_state = {"path": None, "set": False, "env": _UNREAD}    # env: MPIDIST_ALGORITHM_TABLE, once
_tables: dict[str, Table] = {}                    # path -> its table, read once
_generation = [0]             # raised by use_table: every communicator's plan is read again
_lock = threading.Lock()


def use_table(path: str | None) -> None:
    """Make the table at path auto's in this process (None: back to env
    MPIDIST_ALGORITHM_TABLE, read again). Every rank must use the same table; it is read
    (afresh) at the next auto call, and a bad file then raises on every rank."""
    with _lock:
        _state.update(path=path or None, set=path is not None, env=_UNREAD)
        _generation[0] += 1
        _tables.clear()


def table_path() -> str | None:
    """The path of the table auto uses: use_table()'s, else env MPIDIST_ALGORITHM_TABLE (as
    it was at the first auto call, or at the last use_table)."""
    if _state["set"]:
        return _state["path"]
    env = _state["env"]
    if env is _UNREAD:                    # os.environ.get costs microseconds: once
        env = _state["env"] = os.environ.get(ENV_TABLE) or None
    return env


def _table() -> Table | None:
    path = table_path()
    if path is None:
        return None
    table = _tables.get(path)
    if table is None:
        table = load_table(path)
        with _lock:
            _tables[path] = table
    return table


def choose(comm, nbytes: int) -> str:
    """The algorithm auto runs for nbytes (bytes reduced) on comm: the table's entry for
    comm's layout, else rule(); deterministic. ValueError for an unreadable table."""
    plan = comm.auto_plan        # (generation, steps, first end, its name): on the communicator
    if plan is None or plan[0] != _generation[0]:
        plan = comm.auto_plan = _plan(comm)    # read and checked even on one rank
    if 0 < nbytes <= plan[2]:                  # the first row, where most calls fall (one
        return plan[3]                         # rank: every size)
    if nbytes <= 0:                            # nothing to reduce
        return "native"
    if plan[1] is None:
        return rule(comm, nbytes)
    ends, names = plan[1]
    name = names[min(bisect.bisect_left(ends, nbytes), len(names) - 1)]   # past the end: last
    if name == "shm" and not node.usable(comm):
        return rule(comm, nbytes)
    return name


def _plan(comm) -> tuple:
    """comm's row of the table in use, and the first size range, which choose() answers
    without a search: the table's first row (unless shm, which needs its check), or the
    rule's native range; on one rank, native for every size."""
    table = _table()
    found = table.steps.get(_key(layout_of(comm))) if table is not None else None
    if comm.size == 1:
        first = (sys.maxsize, "native")
    elif found is None:
        first = (SMALL_BYTES, "native")
    else:
        ends, names = found
        first = (ends[0], names[0]) if names[0] != "shm" else (0, None)
    return (_generation[0], found) + first


def describe(comm) -> str:
    """One line: where auto's choices on comm come from (a table, or the rule)."""
    path = table_path()
    layout = ", ".join(f"{k} {v}" for k, v in layout_of(comm).items())
    rule_text = f"built-in rule (native up to {format_size(SMALL_BYTES)}, then shm on one " \
                f"node of three or more ranks, hierarchical on uniform nodes, else ring)"
    if path is None:
        return f"{rule_text}; no table (set {ENV_TABLE} or [parallel] algorithm_table)"
    table = _table()
    found = table.steps.get(_key(layout_of(comm)))
    if found is None:
        return f"{rule_text}: table {path} has no entry for this layout ({layout})"
    ends, names = found
    ranges = ", ".join(f"{n} to {format_size(e)}" if e < (1 << 62) else f"{n} beyond"
                       for e, n in zip(ends, names))
    return f"table {path} ({layout}): {ranges}"
