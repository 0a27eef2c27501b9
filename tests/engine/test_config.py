"""Config validation: every problem reported at once, the same message on every rank."""
import glob
import os
import re
import tempfile

import pytest

from mpidist.engine.config import SCHEMA, format_schema, load_config, validate
from mpidist.engine.strategies import STRATEGIES
from mpidist.engine.train import parse_override
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


def test_compression_options_are_checked_by_building_the_compressor():
    cfg = validate({"parallel": {"compression": "topk", "compression_options": {"ratio": 0.05},
                                 "compression_warmup": 3}})
    assert cfg["parallel"]["compression_options"] == {"ratio": 0.05}
    assert cfg["parallel"]["compression_warmup"] == 3
    assert validate({})["parallel"]["compression_options"] == {}
    text = "\n".join(_errors({"parallel": {"compression": "topk", "compression_options": {"ratio": 2}}}))
    assert "[parallel] compression_options: ratio must be in (0, 1]" in text
    text = "\n".join(_errors({"parallel": {"compression": "powersgd", "compression_options": {"levels": 4}}}))
    assert "compressor 'powersgd' takes options rank" in text
    lines = _errors({"parallel": {"compression_options": {"ratio": 0.1}, "compression_warmup": -1}})
    assert any("compression_warmup = -1: must be >= 0" in e for e in lines)
    assert any("compression_options needs compression = '<name>'" in e for e in lines)


@pytest.mark.parametrize("parallel,message", [
    ({"strategy": "ps", "compression": "fp16"}, "strategy = 'ps' exchanges no gradients by allreduce"),
    ({"strategy": "admm", "compression": "topk"}, "strategy = 'admm' exchanges no gradients by allreduce"),
    ({"strategy": "zero", "stage": 2, "compression": "powersgd"}, "works with zero stage = 1 only"),
    ({"strategy": "ps", "accumulation": 2}, "accumulation = 2 is not supported with strategy = 'ps'"),
    ({"strategy": "admm", "accumulation": 3}, "accumulation = 3 is not supported with strategy = 'admm'"),
    ({"strategy": "pipeline", "accumulation": 2}, "raise microbatches"),
])
def test_strategies_reject_what_they_cannot_honour(parallel, message):
    assert any(message in e for e in _errors({"parallel": parallel})), _errors({"parallel": parallel})
    cfg = validate({"parallel": {"strategy": parallel["strategy"]}})
    cfg["parallel"].update(parallel)                  # a config that skipped validate
    with pytest.raises(ConfigError, match=re.escape(message)):
        STRATEGIES[parallel["strategy"]].check_support(cfg)
    for ok in ("dp", "zero", "pipeline"):
        validate({"parallel": {"strategy": ok, "compression": "fp16"}})
    validate({"parallel": {"strategy": "zero", "accumulation": 2}})


@pytest.mark.parametrize("path", JOBS, ids=[os.path.basename(p) for p in JOBS])
def test_shipped_jobs_are_valid(path):
    from mpidist.engine.config import load_toml
    validate(load_toml(path), name="job")


def test_overrides_parse_toml_values():
    assert parse_override("job.epochs=3") == ("job.epochs", 3)
    assert parse_override("parallel.algorithm=tree") == ("parallel.algorithm", "tree")
    assert parse_override("model.hidden=[8, 8]") == ("model.hidden", [8, 8])
    with pytest.raises(ValueError, match="section.key"):
        parse_override("epochs=3")


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

