"""[job] fault_tolerance: config checks, the ULFM check and the pieces a neighbour copy must
cover (no failure injected here: tests/ft/test_shrink.py kills ranks). Any rank count."""
import tomllib

import pytest
from mpi4py import MPI

from mpidist import ulfm
from mpidist.engine.config import validate
from mpidist.errors import ConfigError
from mpidist.ft.recovery import Resilience, pieces_cover

MAIN = "jobs/digits_lamb.toml"


def main_job(**sections):
    with open(MAIN, "rb") as fh:
        raw = tomllib.load(fh)
    for sec, values in sections.items():
        raw.setdefault(sec, {}).update(values)
    return raw


def errors_of(raw) -> str:
    with pytest.raises(ConfigError) as info:
        validate(raw, name="t")
    return str(info.value)


def test_off_by_default_and_shrink_accepted_for_dp_and_zero():
    assert validate(main_job(), name="t")["job"]["fault_tolerance"] == "off"
    validate(main_job(job={"fault_tolerance": "shrink"}), name="t")
    for route in ("neighbour", "checkpoint"):
        validate(main_job(job={"fault_tolerance": "shrink", "shard_restore": route},
                          parallel={"strategy": "zero", "stage": 2}), name="t")


def test_what_shrink_cannot_recover_is_refused_with_every_reason():
    msg = errors_of(main_job(job={"fault_tolerance": "shrink"},
                             parallel={"strategy": "zero", "stage": 3, "compression": "topk"}))
    assert "zero' stage 1 or 2" in msg and "compression = 'none'" in msg
    assert "algorithm = 'shm'" in errors_of(main_job(job={"fault_tolerance": "shrink"},
                                                     parallel={"algorithm": "shm"}))
    assert "needs fault_tolerance = 'shrink'" in errors_of(main_job(job={"shard_restore": "checkpoint"}))
    assert "applies to strategy = 'zero'" in errors_of(
        main_job(job={"fault_tolerance": "shrink", "shard_restore": "neighbour"}))
    assert "interval > 0" in errors_of(main_job(job={"fault_tolerance": "shrink", "shard_restore": "checkpoint"},
                                                parallel={"strategy": "zero", "stage": 2},
                                                checkpoint={"interval": 0}))


def test_without_ulfm_the_job_is_refused_saying_how_to_launch(comm, monkeypatch):
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    config = validate(main_job(job={"fault_tolerance": "shrink"}), name="t")
    with pytest.raises(ConfigError, match="launcher --ft"):
        Resilience(config, comm)
    assert not ulfm.active()


def test_only_process_failures_are_recovered():
    assert ulfm.failure_of(ValueError("x")) is None
    assert ulfm.failure_of(MPI.Exception(MPI.ERR_OTHER)) is None
    try:
        try:
            raise MPI.Exception(MPI.ERR_OTHER)
        except MPI.Exception as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as exc:
        assert ulfm.failure_of(exc) is None


def test_pieces_cover_every_tensor_whole():
    a = {"params/w": ((4, 3), 0, 6), "params/b": ((3,), 0, 3)}
    b = {"params/w": ((4, 3), 6, 6)}
    assert pieces_cover([a, b])
    assert not pieces_cover([a])                                   # w's second half lost
    assert pieces_cover([a, {"params/w": ((4, 3), 4, 8)}])         # overlapping copies
    assert not pieces_cover([a, {"params/w": ((4, 3), 7, 5)}])     # a gap at element 6
    assert not pieces_cover([])


def test_planned_kills_are_read_per_rank_and_a_bad_plan_is_refused():
    from mpidist.errors import ConfigError
    from mpidist.ft.inject import ENV_KILL, KillPlan, parse
    assert parse("0@12, 2@recovery,0@30", 0) == {12, 30}
    assert parse("0@12,2@recovery", 2) == {"recovery"}
    assert parse("", 1) == set() and KillPlan("/tmp", spec="3@5", rank=1).when == set()
    with pytest.raises(ConfigError, match=ENV_KILL):
        parse("rank1@5", 1)
