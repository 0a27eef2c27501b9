"""Config validation: every problem reported at once, the same message on every rank."""
import glob
import os
import tempfile

import pytest

from mpidist.engine.config import SCHEMA, format_schema, load_config, validate
from mpidist.engine.train import _parse_override
from mpidist.errors import ConfigError

JOBS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "*.toml")))


def _errors(raw, **kw):
    with pytest.raises(ConfigError) as info:
        validate(raw, **kw)
    return str(info.value).splitlines()[1:]


def test_defaults_fill_every_key():
    cfg = validate({}, name="x")
    assert set(cfg) == set(SCHEMA) and all(set(cfg[s]) == set(SCHEMA[s]) for s in SCHEMA)
    assert cfg["job"]["name"] == "x" and cfg["job"]["out_dir"] == os.path.join("runs", "x")
    assert isinstance(validate({"optim": {"lr": 1}})["optim"]["lr"], float)


def test_every_problem_is_reported_with_a_hint():
    lines = _errors({"job": {"epoch": 3, "seed": "zero"}, "optimizer": {},
                     "parallel": {"stage": 2, "bucket_mb": -1, "algorithm": "rings"},
                     "model": {"channels": [8]}})
    text = "\n".join(lines)
    assert len(lines) == 7, text
    assert "unknown key 'epoch' (did you mean 'epochs'?)" in text
    assert "unknown section '[optimizer]' (did you mean '[optim]'?)" in text
    assert "seed = 'zero': must be an integer" in text
    assert "bucket_mb = -1: must be >= 0" in text
    assert "algorithm = 'rings': choose one of" in text
    assert "stage applies to strategy = 'zero' only" in text
    assert "[model] channels does not apply to model 'mlp'" in text


def test_cross_section_and_constructor_checks():
    assert any("does not fit" in e for e in _errors({"model": {"name": "gpt"}}))
    assert any("divisible" in e for e in _errors({"model": {"name": "gpt", "dim": 10, "heads": 4},
                                                  "data": {"dataset": "text"}}))
    assert any("[optim]" in e and "momentum" in e for e in _errors({"optim": {"hyper": {"momentum": -1}}}))
    assert any("[optim]" in e for e in _errors({"optim": {"name": "adagrad"}}))
    assert any("servers" in e for e in _errors({"parallel": {"strategy": "ps", "servers": 4}}, world_size=4))
    assert any("no such file" in e for e in _errors({"data": {"dataset": "hdf5", "path": "/nonexistent.h5"}}))


@pytest.mark.parametrize("path", JOBS, ids=[os.path.basename(p) for p in JOBS])
def test_shipped_jobs_are_valid(path):
    from mpidist.engine.config import load_toml
    validate(load_toml(path), name="job")


def test_overrides_parse_toml_values():
    assert _parse_override("job.epochs=3") == ("job.epochs", 3)
    assert _parse_override("parallel.algorithm=tree") == ("parallel.algorithm", "tree")
    assert _parse_override("model.hidden=[8, 8]") == ("model.hidden", [8, 8])
    with pytest.raises(ValueError, match="section.key"):
        _parse_override("epochs=3")


def test_bad_config_gives_the_same_error_on_every_rank(comm):
    path = comm.comm.bcast(tempfile.mkstemp(suffix=".toml")[1] if comm.rank == 0 else None, root=0)
    if comm.rank == 0:
        with open(path, "w") as fh:
            fh.write('[job]\nepochs = "many"\n[parallel]\nalgorithm = "carrier-pigeon"\n')
    comm.comm.Barrier()
    with pytest.raises(ConfigError) as info:
        load_config(path, comm)
    comm.check_same(str(info.value), "config error message")
    assert "epochs" in str(info.value) and "carrier-pigeon" in str(info.value)
    good = load_config(path, comm, overrides={"job.epochs": 2, "parallel.algorithm": "ring"})
    assert good["job"]["epochs"] == 2
    comm.comm.Barrier()
    if comm.rank == 0:
        os.remove(path)


def test_schema_prints_as_toml():
    import tomllib
    parsed = tomllib.loads(format_schema())
    assert set(parsed) == set(SCHEMA)
