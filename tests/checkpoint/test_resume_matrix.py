"""Resume across strategies and world sizes: a checkpoint one strategy saved at p ranks,
loaded by another strategy at q ranks, continues the uninterrupted training curve.

A cell (p, q) runs the training loop (engine.loop.run, its checkpoint hook and loader) twice:
  1. the source strategy on p ranks, straight from step 0 to STEPS, saving at step SAVE_AT;
  2. the target strategy on q ranks, resumed from that step-SAVE_AT file, on to STEPS.
Step SAVE_AT is mid-epoch and the resumed run crosses an epoch boundary (shuffled loader),
the learning rate follows a warm-up + cosine schedule, and the optimizer (AdamW, LAMB or SGD
with momentum) has state; so the resumed losses equal run 1's losses of the same steps
(relative 1e-6, float32 models) only if the parameters, the optimizer moments and step count,
and the loader position all carried over. Both runs' final checkpoints must agree too.

The cover: a Graeco-Latin square of order 4. With a = p - 1, b = q - 1 as elements of
GF(4) (addition is XOR, DOUBLE multiplies by the generator), the source symbol is a + b and
the target symbol a + 2b: each symbol occurs once in every row p and every column q, and
every ordered pair (source symbol, target symbol) occurs in exactly one cell. Symbols:
0 = the pipeline (1F1B, 2 stages; on 4 ranks 2 stages x 2 replicas, as a target with ZeRO-1
inside the stage) on an even world size and dp on an odd one, 1, 2, 3 = ZeRO stage 1, 2, 3.
So all 16 (p, q) pairs run, every strategy is both a source and a target, and the four
same-symbol pairs (column q = 1) reshard one strategy onto one rank. The optimizer of a cell
is OPTIMIZERS[(a + b) % 3].

One pytest session of N ranks runs the cells with max(p, q) <= N (all 16 at N = 4), each run
on a sub-communicator of the first p (then q) ranks while the others sleep at a barrier.
Two more tests: dropout masks continue on the same ranks and strategy (each rank's
generators are in the checkpoint), and bfloat16 ZeRO and fp32 dp resume each other.
"""
import os
import shutil
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpidist.checkpoint import open_checkpoint
from mpidist.checkpoint.hook import CheckpointHook
from mpidist.comm import Communicator
from mpidist.engine.config import validate
from mpidist.engine.loop import run
from mpidist.engine.strategies import build_strategy
from mpidist.state import gather_state
from mpidist.strategy.metrics import read_metrics

SAVE_AT, STEPS = 4, 7        # 96 training rows / batch 32 = 3 steps per epoch
DOUBLE = (0, 2, 3, 1)        # x -> 2x in GF(4) = {0, 1, 2 = t, 3 = t + 1}, t^2 = t + 1
SIZES = (1, 2, 3, 4)
OPTIMIZERS = ({"name": "adamw", "lr": 0.01, "hyper": {"weight_decay": 0.01}},
              {"name": "lamb", "lr": 0.01, "hyper": {"weight_decay": 0.01}},
              {"name": "sgd", "lr": 0.05, "hyper": {"momentum": 0.9, "weight_decay": 1e-4}})
RTOL = 1e-6


def symbols(p: int, q: int) -> tuple[int, int]:
    """(source symbol, target symbol) of cell (p, q): a + b and a + 2b in GF(4)."""
    a, b = p - 1, q - 1
    return a ^ b, a ^ DOUBLE[b]


def parallel_section(symbol: int, size: int, role: str) -> dict:
    """The [parallel] table a symbol stands for on `size` ranks (role: source | target)."""
    if symbol == 0 and size % 2 == 0:
        section = {"strategy": "pipeline", "stages": 2, "microbatches": 4, "schedule": "1f1b"}
        if size == 4 and role == "target":
            section["zero"] = 1
        return section
    if symbol == 0:
        return {"strategy": "dp", "bucket_mb": 0.001}            # 2 buckets of the 484 params
    return {"strategy": "zero", "stage": symbol, "bucket_mb": 0.001}


def describe(section: dict, size: int) -> str:
    """A short name of a strategy on `size` ranks, e.g. zero3@3, pipeline2x2+zero1@4."""
    name = section["strategy"]
    if name == "zero":
        name += str(section["stage"])
    if name == "pipeline":
        name += f"{section['stages']}x{size // section['stages']}" + ("+zero1" if section.get("zero") else "")
    return f"{name}@{size}"


CELLS = [(p, q) for p in SIZES for q in SIZES]


def cell_plan(p: int, q: int):
    """(source [parallel], target [parallel], [optim]) of cell (p, q)."""
    s, t = symbols(p, q)
    return (parallel_section(s, p, "source"), parallel_section(t, q, "target"),
            OPTIMIZERS[(p - 1 + q - 1) % 3])


def test_the_cover_is_a_graeco_latin_square():
    """Every (p, q) once, every ordered symbol pair once, every strategy as source and as
    target, the pipeline only on even world sizes, every optimizer used."""
    pairs = [symbols(p, q) for p, q in CELLS]
    assert sorted(pairs) == [(s, t) for s in range(4) for t in range(4)]
    for p in SIZES:
        assert sorted(symbols(p, q)[0] for q in SIZES) == [0, 1, 2, 3]
        assert sorted(symbols(p, q)[1] for q in SIZES) == [0, 1, 2, 3]
    plans = {(p, q): cell_plan(p, q) for p, q in CELLS}
    sources = {describe(src, p).split("@")[0] for (p, q), (src, _, _) in plans.items()}
    targets = {describe(dst, q).split("@")[0] for (p, q), (_, dst, _) in plans.items()}
    strategies = {"dp", "zero1", "zero2", "zero3"}
    assert strategies <= sources and strategies <= targets
    assert {"pipeline2x1", "pipeline2x2"} <= sources
    assert {"pipeline2x1", "pipeline2x2+zero1"} <= targets
    for (p, q), (src, dst, _) in plans.items():
        assert src["strategy"] != "pipeline" or p % 2 == 0
        assert dst["strategy"] != "pipeline" or q % 2 == 0
    assert {o["name"] for _, _, o in plans.values()} == {"adamw", "lamb", "sgd"}


def job_config(out_dir: str, data_dir: str, parallel: dict, optim: dict, resume: bool,
               dropout: float = 0.0) -> dict:
    return validate({
        "job": {"steps": STEPS, "eval_every": 0, "progress": False, "plot": False, "seed": 5,
                "out_dir": out_dir},
        "model": {"name": "mlp", "hidden": [16, 16], "dropout": dropout},
        "data": {"dataset": "synthetic", "samples": 120, "features": 8, "classes": 4,
                 "test_fraction": 0.2, "batch_size": 32, "shuffle": True, "cache_dir": data_dir},
        "optim": {**optim, "schedule": "cosine", "warmup_steps": 2},
        "parallel": {**parallel, "algorithm": "ring"},
        "checkpoint": {"interval": SAVE_AT, "keep": 2, "dir": os.path.join(out_dir, "ckpt"),
                       "resume": resume},
    }, name=os.path.basename(out_dir))


def on_first_ranks(world: Communicator, n: int, fn) -> None:
    """Collective over world: fn(Communicator of world's first n ranks) there, while the other
    ranks sleep (not spin) until all are done; an error anywhere is raised on every rank."""
    sub = world.comm.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
    error = None
    if sub != MPI.COMM_NULL:
        comm = Communicator(sub)
        try:
            fn(comm)
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            error = exc
        finally:
            comm.free()
            sub.Free()
    done = world.comm.Ibarrier()
    while not done.Test():
        time.sleep(0.002)
    world.raise_if_any(error)


def _steps(out_dir: str) -> dict:
    return {r["step"]: r for r in read_metrics(os.path.join(out_dir, "metrics.jsonl"))
            if r["event"] == "step"}


@pytest.mark.parametrize("p, q", [pytest.param(p, q, marks=pytest.mark.mpi(min_size=max(p, q)),
                                               id=f"p{p}-q{q}") for p, q in CELLS])
def test_saved_at_p_by_one_strategy_resumed_at_q_by_another(comm, shared_dir, p, q):
    source, target, optim = cell_plan(p, q)
    what = f"{describe(source, p)} -> {describe(target, q)}, {optim['name']}"
    data = os.path.join(shared_dir, "data")
    straight, resumed = os.path.join(shared_dir, "straight"), os.path.join(shared_dir, "resumed")
    on_first_ranks(comm, p, lambda c: run(job_config(straight, data, source, optim, False), c))
    if comm.rank == 0:
        os.makedirs(os.path.join(resumed, "ckpt"))
        shutil.copy(os.path.join(straight, "ckpt", f"ckpt-{SAVE_AT:08d}.h5"), os.path.join(resumed, "ckpt"))
    on_first_ranks(comm, q, lambda c: run(job_config(resumed, data, target, optim, True), c))

    # the resumed run's steps follow the straight run's curve
    a, b = _steps(straight), _steps(resumed)
    assert sorted(b) == list(range(SAVE_AT + 1, STEPS + 1)), what
    for step in b:
        assert b[step]["epoch"] == a[step]["epoch"], what
        np.testing.assert_allclose(b[step]["lr"], a[step]["lr"], rtol=1e-12, err_msg=what)
        np.testing.assert_allclose(b[step]["loss"], a[step]["loss"], rtol=RTOL, atol=0,
                                   err_msg=f"{what}: loss at step {step}")
    # ... and end in the same state: parameters, optimizer states and step count
    ends = [os.path.join(d, "ckpt", f"ckpt-{STEPS:08d}.h5") for d in (straight, resumed)]
    with open_checkpoint(ends[0], comm=comm) as x, open_checkpoint(ends[1], comm=comm) as y:
        assert (x.world_size, y.world_size) == (p, q), what
        assert sorted(x.keys()) == sorted(y.keys()), what
        assert any(k.startswith("optim/") for k in x.keys()), what
        assert x.scalars["optim_step"] == y.scalars["optim_step"] == STEPS, what
        for key in x.keys():
            u, v = x.read_full(key).astype(np.float64), y.read_full(key).astype(np.float64)
            scale = max(float(np.abs(u).max()), np.finfo(np.float32).tiny)
            assert float(np.abs(u - v).max()) <= RTOL * scale, f"{what}: {key} differs"


@pytest.mark.parametrize("parallel", [
    pytest.param({"strategy": "dp"}, id="dp"),
    pytest.param({"strategy": "zero", "stage": 3}, id="zero3"),
    pytest.param({"strategy": "pipeline", "stages": 2, "microbatches": 4}, id="pipeline",
                 marks=pytest.mark.mpi(min_size=2))])
def test_dropout_masks_continue_when_resumed_on_the_same_ranks(comm, shared_dir, parallel):
    """Each rank's dropout generators are checkpointed: resumed with the same strategy on
    the same ranks, the run draws the masks the uninterrupted run drew (bit-identical
    losses). On another world size or strategy the masks cannot match: there each rank's
    generators start again from the seed."""
    n = comm.size - comm.size % 2 if parallel["strategy"] == "pipeline" else comm.size
    data = os.path.join(shared_dir, "data")
    straight, resumed = os.path.join(shared_dir, "straight"), os.path.join(shared_dir, "resumed")
    on_first_ranks(comm, n, lambda c: run(job_config(straight, data, parallel, OPTIMIZERS[0], False,
                                                     dropout=0.3), c))
    if comm.rank == 0:
        os.makedirs(os.path.join(resumed, "ckpt"))
        shutil.copy(os.path.join(straight, "ckpt", f"ckpt-{SAVE_AT:08d}.h5"), os.path.join(resumed, "ckpt"))
    on_first_ranks(comm, n, lambda c: run(job_config(resumed, data, parallel, OPTIMIZERS[0], True,
                                                     dropout=0.3), c))
    a, b = _steps(straight), _steps(resumed)
    assert sorted(b) == list(range(SAVE_AT + 1, STEPS + 1))
    assert [b[s]["loss"] for s in b] == [a[s]["loss"] for s in b]


def _resumed_state(comm, config: dict):
    """Collective: build config's strategy, resume it through the checkpoint hook, and
    gather its state whole (InMemoryState) on every rank."""
    config = {**config, "job": {**config["job"], "total_steps": STEPS, "steps_per_epoch": 3}}
    strategy = build_strategy(config, comm, {"kind": "classification", "in_shape": [8], "classes": 4})
    hook = CheckpointHook(config, comm)
    try:
        assert hook.resume(strategy)
    finally:
        hook.close()
    state = gather_state(strategy.state_dict(), comm)
    strategy.close()
    return state


def test_half_precision_zero_and_full_precision_strategies_resume_each_other(comm, shared_dir):
    """An fp32 dp checkpoint resumes bfloat16 ZeRO (its fp32 masters taken from the fp32
    params), and that run's checkpoint resumes fp32 dp on another world size from the
    masters, not from the parameters rounded to 16 bits."""
    bf16 = {"strategy": "zero", "stage": 2, "dtype": "bfloat16"}
    data, fp32_run, half = (os.path.join(shared_dir, n) for n in ("data", "fp32", "half"))
    q = max(1, comm.size - 1)
    on_first_ranks(comm, comm.size, lambda c: run(job_config(fp32_run, data, {"strategy": "dp"},
                                                             OPTIMIZERS[0], False), c))
    if comm.rank == 0:
        os.makedirs(os.path.join(half, "ckpt"))
        shutil.copy(os.path.join(fp32_run, "ckpt", f"ckpt-{SAVE_AT:08d}.h5"), os.path.join(half, "ckpt"))
    with open_checkpoint(os.path.join(half, "ckpt", f"ckpt-{SAVE_AT:08d}.h5"), comm=comm) as src:
        written = {k: src.read_full(k) for k in src.keys()}
    got = _resumed_state(comm, job_config(half, data, bf16, OPTIMIZERS[0], True))
    for key, value in written.items():
        if key.startswith("params/"):
            assert np.array_equal(got.tensors["optim/master/" + key[7:]], value), key
            assert np.array_equal(got.tensors[key], value.astype(got.tensors[key].dtype)), key
        else:
            assert np.array_equal(got.tensors[key], value), key
    run(job_config(half, data, bf16, OPTIMIZERS[0], True), comm)    # on to STEPS, saved there

    back = {}
    on_first_ranks(comm, q, lambda c: back.update(state=_resumed_state(
        c, job_config(half, data, {"strategy": "dp"}, OPTIMIZERS[0], True))))
    with open_checkpoint(os.path.join(half, "ckpt", f"ckpt-{STEPS:08d}.h5"), comm=comm) as src:
        assert src.world_size == comm.size and src.scalars["param_dtype"] == "bfloat16"
        masters = {k[len("optim/master/"):]: src.read_full(k) for k in src.keys() if k.startswith("optim/master/")}
    assert masters
    if comm.rank < q:
        for name, value in masters.items():
            assert np.array_equal(back["state"].tensors[f"params/{name}"], value), name
