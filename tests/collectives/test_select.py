"""algorithm="auto" (collectives.select): the decision table and the built-in rule, and the
table `mpidist tune` writes (collectives.tuning.tune) read back and obeyed."""
import json
import os

import numpy as np
import pytest

from mpidist import ulfm
from mpidist.bench import allreduce as bench_allreduce
from mpidist.collectives import ALGORITHMS, allreduce, flight, node, select, shm
from mpidist.collectives.core import prepare_allreduce
from mpidist.collectives.tuning import explain, tune
from mpidist.errors import RemoteError


@pytest.fixture(autouse=True)
def no_table(monkeypatch):
    """Each test starts with no table and leaves none behind."""
    monkeypatch.delenv(select.ENV_TABLE, raising=False)
    select.use_table(None)
    yield
    select.use_table(None)


def _shared_dir(comm, tmp_path) -> str:
    return comm.comm.bcast(str(tmp_path), root=0)


def _write(comm, path: str, data) -> None:
    if comm.rank == 0:
        with open(path, "w") as f:
            f.write(data if isinstance(data, str) else json.dumps(data))
    comm.comm.Barrier()


def _table(layout: dict, rows: list) -> dict:
    return {"format": select.FORMAT, "layouts": [{**layout, "sizes": rows}]}


def _auto_name(comm, nbytes: int) -> str:
    """The algorithm the public allreduce resolves "auto" to for float32 data of nbytes."""
    x = np.ones(max(1, nbytes // 4), np.float32)
    *_, name, entry = prepare_allreduce(comm, x, "sum", "auto", None)
    flight.end(entry)
    return name


def test_the_rule_without_a_table(comm):
    small, large = select.SMALL_BYTES, 4 * select.SMALL_BYTES
    assert select.choose(comm, small) == select.rule(comm, small) == "native"
    if comm.size == 1:
        expect = "native"
    elif comm.num_nodes == 1:
        expect = "shm" if comm.size > 2 else "ring"
    elif comm.uniform_nodes and comm.local_size > 1:
        expect = "hierarchical"
    else:
        expect = "ring"
    assert select.choose(comm, large) == expect == _auto_name(comm, large)
    assert shm.preferred(comm) == (expect == "shm")      # reduce_scatter/allgather's auto too
    assert "built-in rule" in select.describe(comm)


def test_fault_tolerance_never_chooses_shm(comm, tmp_path, monkeypatch):
    """Under ULFM shm is unusable: the rule passes it by, and a table's shm gives way to it."""
    monkeypatch.setattr(ulfm, "active", lambda: True)
    path = os.path.join(_shared_dir(comm, tmp_path), "t.json")
    _write(comm, path, _table(select.layout_of(comm), [{"upto": None, "algorithm": "shm"}]))
    for table in (None, path):
        select.use_table(table)
        for n in (64, 1 << 20, 64 << 20):
            assert select.choose(comm, n) != "shm"
            assert select.choose(comm, n) == select.rule(comm, n)


def test_a_table_is_obeyed_for_its_layout_only(comm, tmp_path):
    path = os.path.join(_shared_dir(comm, tmp_path), "t.json")
    mine = select.layout_of(comm)
    other = {**mine, "ranks": comm.size + 1}
    doc = _table(mine, [{"upto": "1K", "algorithm": "tree"}, {"upto": 1 << 20, "algorithm": "ring"},
                        {"upto": None, "algorithm": "recursive_doubling"}])
    doc["layouts"].append({**other, "sizes": [{"upto": None, "algorithm": "dbtree"}]})
    _write(comm, path, doc)
    select.use_table(path)
    got = [_auto_name(comm, n) for n in (512, 1024, 2048, 1 << 20, 4 << 20)]
    if comm.size > 1:
        assert got == ["tree", "tree", "ring", "ring", "recursive_doubling"]
        assert select.describe(comm).startswith(f"table {path}")
    else:
        assert got == ["native"] * 5                    # one rank: nothing to reduce
    x = np.arange(1000, dtype=np.float32)
    assert np.array_equal(allreduce(x, comm=comm), np.arange(1000) * comm.size)
    # no entry for this layout: the rule
    _write(comm, path, _table(other, [{"upto": None, "algorithm": "dbtree"}]))
    select.use_table(path)
    for n in (512, 4 << 20):
        assert select.choose(comm, n) == select.rule(comm, n)
    assert "no entry for this layout" in select.describe(comm) or comm.size == 1


def test_the_env_variable_names_the_table(comm, tmp_path, monkeypatch):
    path = os.path.join(_shared_dir(comm, tmp_path), "t.json")
    _write(comm, path, _table(select.layout_of(comm), [{"upto": None, "algorithm": "tree"}]))
    monkeypatch.setenv(select.ENV_TABLE, path)
    assert select.table_path() == path
    assert select.choose(comm, 1 << 20) == ("tree" if comm.size > 1 else "native")


@pytest.mark.parametrize("text, words", [
    ("{not json", "not valid JSON"),
    ('{"layouts": []}', "not a table"),
    ({"format": select.FORMAT, "layouts": [{"ranks": 2, "nodes": 1, "ranks_per_node": 2,
                                             "sizes": [{"upto": None, "algorithm": "bogus"}]}]},
     "'bogus' is not one of"),
    ({"format": select.FORMAT, "layouts": [{"ranks": 2, "nodes": 1, "ranks_per_node": 2,
                                             "sizes": [{"upto": "1M", "algorithm": "ring"},
                                                       {"upto": "4K", "algorithm": "tree"}]}]},
     "does not grow"),
    ({"format": select.FORMAT, "layouts": [{"ranks": 2, "nodes": 1, "ranks_per_node": 2,
                                             "sizes": [{"upto": None, "algorithm": "ring"},
                                                       {"upto": "4K", "algorithm": "tree"}]}]},
     "only the last row"),
    ({"format": select.FORMAT, "layouts": [{"ranks": 0, "nodes": 1, "ranks_per_node": 2,
                                             "sizes": [{"upto": None, "algorithm": "ring"}]}]},
     "ranks must be a positive integer"),
])
def test_a_bad_table_raises_on_every_rank(comm, tmp_path, text, words):
    path = os.path.join(_shared_dir(comm, tmp_path), "bad.json")
    _write(comm, path, text)
    with pytest.raises(ValueError, match=words):
        select.load_table(path)
    select.use_table(path)
    x = np.ones(100, np.float32)
    with pytest.raises(ValueError, match="allreduce algorithm table .*mpidist tune"):
        allreduce(x, comm=comm)
    assert np.all(x == 1)                               # nothing moved
    x = np.ones(100, np.float32)
    assert np.all(allreduce(x, comm=comm, algorithm="ring") == comm.size)  # still in step


def test_a_table_missing_on_one_rank_fails_every_rank(comm, tmp_path):
    root = _shared_dir(comm, tmp_path)
    good = os.path.join(root, "t.json")
    _write(comm, good, _table(select.layout_of(comm), [{"upto": None, "algorithm": "ring"}]))
    select.use_table(os.path.join(root, "missing.json") if comm.rank == 0 else good)
    expected = ValueError if comm.rank == 0 else RemoteError
    with pytest.raises(expected, match="cannot read it"):
        allreduce(np.ones(10, np.float32), comm=comm)


def test_tune_writes_a_table_that_is_read_back_and_obeyed(comm, tmp_path):
    path = os.path.join(_shared_dir(comm, tmp_path), "tuned.json")
    sizes = [1 << 10, 64 << 10, 1 << 20]
    entry = tune.tune(comm, sizes, reps=1)
    picks = [m["pick"] for m in entry["measured"]]
    assert comm.comm.allgather(picks) == [picks] * comm.size      # the same on every rank
    for m in entry["measured"]:
        assert m["pick"] in m["us"] and m["rule"] in m["us"]     # the rule's pick is timed
        assert m["pick"] in m["behind"] and all(
            len(b) == (1 if comm.size == 1 else tune.PASSES) for b in m["behind"].values())
    other = {"ranks": comm.size + 1, "nodes": 1, "ranks_per_node": comm.size + 1,
             "sizes": [{"upto": None, "algorithm": "tree"}]}
    if comm.rank == 0:
        with open(path, "w") as f:
            json.dump({"format": select.FORMAT, "layouts": [other]}, f)
        tune.write_table(path, entry, {"by": "test"})
    comm.comm.Barrier()
    with open(path) as f:
        doc = json.load(f)
    assert doc["layouts"][0] == other and len(doc["layouts"]) == 2   # other layouts kept
    select.use_table(path)
    assert [select.choose(comm, n) for n in sizes] == picks
    rows = explain.explain(sizes, comm)                 # explain reads what auto runs
    assert [r["auto"] for r in rows] == picks
    assert all(r["tuned"]["bytes"] == n and r["tuned"]["pick"] == r["auto"]
               for r, n in zip(rows, sizes))
    if comm.size > 1:
        assert all(r["source"].startswith("table row ") for r in rows)


def test_explain_names_the_table_row_or_the_rule(comm, tmp_path):
    """Per size: auto's algorithm, the rule's beside it, and which decided; no timing
    unless asked, then every candidate once per round."""
    sizes = [1 << 10, 1 << 20, 4 << 20]
    rows = explain.explain(sizes, comm)
    assert [r["auto"] for r in rows] == [select.choose(comm, n) for n in sizes]
    assert [r["rule"] for r in rows] == [select.rule(comm, n) for n in sizes]
    assert all(r["auto"] == r["rule"] and r["tuned"] is None and r["measured"] is None
               for r in rows)
    assert all(r["source"] == ("one rank: native" if comm.size == 1 else "rule (no table)")
               for r in rows)
    path = os.path.join(_shared_dir(comm, tmp_path), "t.json")
    _write(comm, path, _table(select.layout_of(comm), [{"upto": "4K", "algorithm": "tree"},
                                                       {"upto": None, "algorithm": "ring"}]))
    select.use_table(path)
    rows = explain.explain(sizes, comm, reps=1)
    if comm.size > 1:
        assert [r["auto"] for r in rows] == ["tree", "ring", "ring"]
        assert [r["source"] for r in rows] == ["table row 1 (to 4K)"] + \
            ["table row 2 (open-ended)"] * 2
    assert all(set(r["measured"]) == set(tune.candidates(comm) if comm.size > 1
                                         else ["native"]) for r in rows)
    assert all(t > 0 for r in rows for t in r["measured"].values())


def test_tune_times_every_algorithm_the_benchmark_holds_auto_against(comm):
    """The tuner's candidates are the benchmark's: the registry, shm only where usable."""
    names = tune.candidates(comm)
    assert "hierarchical" in names and select.rule(comm, 64 << 20) in names
    runnable = set(ALGORITHMS) if node.usable(comm) else set(ALGORITHMS) - {"shm"}
    assert set(names) == runnable


def test_the_tune_ladder_is_the_benchmark_sizes():
    """Every size `mpidist bench allreduce` measures by default has its own tuned row."""
    assert tune.DEFAULT_SIZES == bench_allreduce.DEFAULT_SIZES


def test_behind_pairs_each_round_with_the_fastest():
    times = {"a": np.array([1.0, 2.0, 1.0]), "b": np.array([1.1, 2.2, 0.9])}
    assert tune.behind(times, ["a", "b"]) == {"a": 1.0, "b": pytest.approx(1.1)}


@pytest.mark.parametrize("rule, other, pick", [
    ([1.02, 1.02, 1.02], [1.0, 1.0, 1.0], "rule"),        # a gain smaller than MIN_GAIN
    ([1.20, 1.15, 1.25], [1.0, 1.0, 1.0], "other"),       # ahead in every pass
    ([1.16, 1.00, 1.10], [1.00, 1.22, 1.00], "rule"),     # passes disagree: no clear margin
    ([1.0, 1.0, 1.30], [1.02, 1.01, 1.0], "rule"),        # one pass: margin within its spread
    ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], "rule")])
def test_decide_keeps_the_rules_pick_unless_another_is_clearly_less_behind(rule, other, pick):
    passes = [{"rule": r, "other": o} for r, o in zip(rule, other)]
    assert tune.decide(passes, "rule") == pick


@pytest.mark.parametrize("native, other, pick", [
    ([1.01, 1.00, 1.02], [1.0, 1.01, 1.0], "native"),     # a tie with the least: native
    ([1.10, 1.12, 1.09], [1.0, 1.0, 1.0], "other"),       # clearly behind: the least
    ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], "native")])
def test_decide_gives_a_tie_the_rule_loses_to_native(native, other, pick):
    """The rule's pick is clearly behind: a tie between the least behind and native goes to
    native."""
    passes = [{"rule": 1.3, "native": n, "other": o} for n, o in zip(native, other)]
    assert tune.decide(passes, "rule") == pick


def test_a_job_config_checks_its_table(tmp_path):
    from mpidist.engine.config import validate
    from mpidist.errors import ConfigError
    missing = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match=r"\[parallel\] algorithm_table: allreduce algorithm "
                                          r"table .*missing.json: cannot read it"):
        validate({"parallel": {"algorithm_table": missing}})
