"""[job] fault_tolerance: config checks, the ULFM check, the pieces a neighbour copy must
cover and the copy's message, and the state a recovery would restore, taken without a failure
(tests/ft/test_shrink.py kills ranks). Any rank count."""
import tomllib

import mpi4py
import numpy as np
import pytest
from mpi4py import MPI

from mpidist import ulfm
from mpidist.engine.config import validate
from mpidist.engine.strategies import build_strategy
from mpidist.errors import ConfigError
from mpidist.ft.recovery import Resilience, describe, packed, pieces_cover, spans_of, unpack
from mpidist.state import StateDict, TensorPiece, gather_state
from tests.zero.test_strategy import META, config, run

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


def test_off_by_default_and_shrink_accepted_for_dp_zero_diloco_and_local_sgd():
    assert validate(main_job(), name="t")["job"]["fault_tolerance"] == "off"
    validate(main_job(job={"fault_tolerance": "shrink"}), name="t")
    for route in ("neighbour", "checkpoint"):
        validate(main_job(job={"fault_tolerance": "shrink", "shard_restore": route},
                          parallel={"strategy": "zero", "stage": 2}), name="t")
    for strategy in ("diloco", "local_sgd"):
        validate(main_job(job={"fault_tolerance": "shrink"}, parallel={"strategy": strategy, "group_size": 2,
                                                                       "outer_fragments": 2}), name="t")


def test_what_shrink_cannot_recover_is_refused_with_every_reason():
    msg = errors_of(main_job(job={"fault_tolerance": "shrink"},
                             parallel={"strategy": "zero", "stage": 3, "compression": "topk"}))
    assert "zero' stage 1 or 2" in msg and "compression = 'none'" in msg
    assert "algorithm = 'shm'" in errors_of(main_job(job={"fault_tolerance": "shrink"},
                                                     parallel={"algorithm": "shm"}))
    assert "needs fault_tolerance = 'shrink'" in errors_of(main_job(job={"shard_restore": "checkpoint"}))
    assert "outer_compression = 'none'" in errors_of(
        main_job(job={"fault_tolerance": "shrink"}, parallel={"strategy": "diloco", "outer_compression": "sign"}))
    assert "'diloco' and 'local_sgd'" in errors_of(
        main_job(job={"fault_tolerance": "shrink"}, parallel={"strategy": "diloco_async"}))
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


def test_a_copy_travels_as_one_message_and_comes_back_whole():
    sd = StateDict(7, {"params/w": TensorPiece((4, 3), 4, np.arange(6, dtype=np.float32)),
                       "optim/m/w": TensorPiece((4, 3), 4, np.ones(6, np.float16)),
                       "params/b": TensorPiece((3,), 0, np.array([1.5, 2.5, 3.5]))}, {})
    pieces = describe(sd)
    raw = packed(sd, pieces)
    assert raw.dtype == np.uint8 and [k for k, *_ in pieces] == sorted(sd.tensors)
    back = unpack((raw.size, pieces), raw.copy())
    for key, piece in sd.tensors.items():
        got = back[key]
        assert (got.shape, got.offset, got.dtype) == (piece.shape, piece.offset, piece.dtype)
        assert np.array_equal(got.data, piece.data)
    assert spans_of((raw.size, pieces))["params/w"] == ((4, 3), 4, 6)


@pytest.mark.parametrize("strategy", ["dp", "zero"])
def test_the_state_a_recovery_restores_is_the_strategys_whole_state(comm, monkeypatch, strategy):
    """dp: this rank's replica; zero: the shards and the neighbours' copies, exchanged as raw
    messages after every step and assembled (rank 0's shard from its neighbour's copy)."""
    monkeypatch.setattr(ulfm, "active", lambda: True)
    monkeypatch.setattr(mpi4py.rc, "fast_reduce", False)
    cfg = config(strategy, **({"stage": 2} if strategy == "zero" else {}))
    s = build_strategy(cfg, comm, META)
    res = Resilience(cfg, comm)
    res.attach(s, None)
    *_, want = run(s, comm)
    res.after_step(s)
    if strategy == "zero" and comm.size > 1 and comm.rank == 0:
        res._mine.clear()       # rank 0's own copies lost: its shard comes from rank 1's copy
    got = res._agree()
    assert got.step == want.step == 4 and sorted(got.keys()) == sorted(want.keys())
    for key in want.keys():
        assert np.array_equal(got.tensors[key], want.tensors[key]), key
    assert got.scalars == want.scalars
    s.close()


def test_planned_kills_are_read_per_rank_and_a_bad_plan_is_refused():
    from mpidist.errors import ConfigError
    from mpidist.ft.inject import ENV_KILL, KillPlan, parse
    assert parse("0@12, 2@recovery,0@30", 0) == {12, 30}
    assert parse("0@12,2@recovery", 2) == {"recovery"}
    assert parse("", 1) == set() and KillPlan("/tmp", spec="3@5", rank=1).when == set()
    with pytest.raises(ConfigError, match=ENV_KILL):
        parse("rank1@5", 1)


def test_a_planned_kill_lands_within_the_next_step(monkeypatch):
    """The kill's delay is at most 50 ms and at most the step before's length, so that a
    short job's last steps cannot all pass before it (the job would end unbroken)."""
    import random
    import types
    from mpidist.ft import inject
    delays = []

    class Timer:                        # records the delay instead of killing this process
        def __init__(self, delay, fn):
            delays.append(delay)

        def start(self):
            pass
    monkeypatch.setattr(inject.threading, "Timer", Timer)
    clock = iter([10.0, 10.002, 10.004, 11.0, 11.5, 11.502])
    monkeypatch.setattr(inject, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    plan = inject.KillPlan("/tmp", spec="0@1,0@2,0@4,0@5", rank=0)
    for step in range(6):
        plan.after_step(step)
    # step 1: the first measured step (2 ms); 2: 2 ms; 4: 0.5 s, so the 50 ms cap; 5: 2 ms
    assert len(delays) == 4 and all(d >= 0 for d in delays)
    assert delays[0] <= 0.002 and delays[1] <= 0.002 and delays[3] <= 0.002
    assert delays[2] <= 0.05
    assert delays[2] == pytest.approx(random.Random(4).uniform(0, 0.05))
