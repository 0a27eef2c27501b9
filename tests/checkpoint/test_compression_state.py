"""Compression state in checkpoints (mpidist.strategy.compression_state): residuals one row per
replica, restored exactly at the same replica count and by the sum rule at another; training
resumed with top-k / PowerSGD follows the uninterrupted loss curve."""
import json
import os

import numpy as np
import pytest

from mpidist.compress import CompressedAllreduce, make_compressor
from mpidist.strategy.compression_state import (compression_pieces, compression_scalars,
                                              restore_compression)
from mpidist.engine.config import validate
from mpidist.engine.loop import run
from mpidist.flat import Layout
from mpidist.state import InMemoryState, StateDict, gather_state

LAYOUT = Layout([("fc.weight", (6, 5)), ("fc.bias", (5,)), ("out.weight", (4, 5))])
BUCKETS = [(0, 30), (30, 25)]          # two buckets of whole tensors


def _grads(rank, step):
    return np.random.default_rng([rank, step]).standard_normal(LAYOUT.numel).astype(np.float32)


def _trained(comm, name, opts, steps=3):
    """A CompressedAllreduce after `steps` calls on this rank's gradients, bucket by bucket."""
    ca = CompressedAllreduce(make_compressor(name, **opts), comm)
    for t in range(steps):
        flat = _grads(comm.rank, t)
        for lo, n in BUCKETS:
            ca.allreduce_async(flat[lo:lo + n], layout=LAYOUT).wait()
    return ca


def _saved(comm, ca) -> InMemoryState:
    sd = StateDict(3, compression_pieces(ca, LAYOUT, comm.rank, comm.size),
                   {"compression": compression_scalars(ca)})
    return gather_state(sd, comm)


def _residual(ca):
    return np.concatenate([csd["residual"] for _, _, csd in sorted(ca.state_dict()["buffers"])])


@pytest.mark.parametrize("name,opts", [("topk", {"ratio": 0.2}), ("powersgd", {"rank": 2})])
def test_same_replica_count_restores_exactly(comm, name, opts):
    ca = _trained(comm, name, opts)
    src = _saved(comm, ca)
    assert src.shape("compress/residual/fc.weight") == (comm.size, 6, 5)
    again = CompressedAllreduce(make_compressor(name, **opts), comm)
    restore_compression(again, src, LAYOUT, BUCKETS, comm.rank, comm.size)
    want, got = ca.state_dict(), again.state_dict()
    assert got["step"] == want["step"] and got["skipped_steps"] == want["skipped_steps"]
    for (key, calls, csd), (key2, calls2, csd2) in zip(sorted(want["buffers"]), sorted(got["buffers"])):
        assert key == key2 and calls == calls2 and csd["step"] == csd2["step"]
        for k, v in csd.items():
            if isinstance(v, np.ndarray):
                np.testing.assert_array_equal(csd2[k], v, err_msg=k)
    # the next call gives the same result
    fa, fb = _grads(comm.rank, 9), _grads(comm.rank, 9)
    for lo, n in BUCKETS:
        a = ca.allreduce_async(fa[lo:lo + n], layout=LAYOUT).wait()
        b = again.allreduce_async(fb[lo:lo + n], layout=LAYOUT).wait()
        np.testing.assert_array_equal(a, b)


def test_other_replica_count_keeps_the_residual_sum(comm):
    ca = _trained(comm, "powersgd", {"rank": 2})
    src = _saved(comm, ca)
    total = sum(np.asarray(r, np.float64) for r in comm.comm.allgather(_residual(ca)))
    q_saved = dict((tuple(k), csd["q"]) for k, _, csd in ca.state_dict()["buffers"])
    for replicas in (1, 2, 3, 5):
        if replicas == comm.size:
            continue
        rows = []
        for r in range(replicas):
            new = CompressedAllreduce(make_compressor("powersgd", rank=2), comm)
            restore_compression(new, src, LAYOUT, BUCKETS, r, replicas)
            rows.append(_residual(new))
            for key, calls, csd in new.state_dict()["buffers"]:
                assert calls == 3 and csd["step"] == 3
                np.testing.assert_allclose(csd["q"], q_saved[tuple(key)], rtol=1e-6)  # shared Q
        np.testing.assert_allclose(sum(np.asarray(r, np.float64) for r in rows), total, atol=1e-5)
        np.testing.assert_allclose(rows[0], total / replicas, atol=1e-6)   # spread evenly


def test_checkpoints_without_compression_state_start_from_zero(comm):
    src = InMemoryState(5, {"params/fc.bias": np.zeros(5, np.float32)}, {"optim_step": 5})
    ca = CompressedAllreduce(make_compressor("topk", ratio=0.2), comm)
    restore_compression(ca, src, LAYOUT, BUCKETS, comm.rank, comm.size)
    for _, calls, csd in ca.state_dict()["buffers"]:
        assert calls == 0 and csd["step"] == 0 and csd["residual"] is None
    # another compressor's checkpoint: its residuals, not its counters or arrays
    other = _saved(comm, _trained(comm, "topk", {"ratio": 0.2}))
    ca = CompressedAllreduce(make_compressor("powersgd", rank=2), comm)
    restore_compression(ca, other, LAYOUT, BUCKETS, comm.rank, comm.size)
    for _, calls, csd in ca.state_dict()["buffers"]:
        assert calls == 0 and csd["step"] == 0 and csd.get("q") is None
    assert np.abs(_residual(ca)).sum() > 0


# ------------------------------------------------------------------ through the engine
def _config(tmp, name, steps, parallel, resume=False):
    raw = {"job": {"name": name, "steps": steps, "progress": False, "plot": False,
                   "out_dir": os.path.join(tmp, name)},
           "model": {"name": "mlp", "hidden": [32]},
           "data": {"dataset": "digits", "batch_size": 60, "cache_dir": tmp},
           "optim": {"name": "sgd", "lr": 0.2, "hyper": {"momentum": 0.9}},
           "parallel": parallel,
           "checkpoint": {"interval": 3, "dir": os.path.join(tmp, name + "-ckpt"), "resume": resume}}
    return raw


def _losses(path) -> dict:
    rows = [json.loads(line) for line in open(path)]
    return {r["step"]: r["loss"] for r in rows if r.get("event") == "step"}


@pytest.mark.parametrize("parallel", [
    {"strategy": "dp", "compression": "topk", "compression_options": {"ratio": 0.05},
     "compression_warmup": 1, "bucket_mb": 0.01},
    {"strategy": "dp", "compression": "powersgd", "compression_options": {"rank": 2}},
    {"strategy": "zero", "stage": 1, "compression": "topk", "compression_options": {"ratio": 0.05}},
    {"strategy": "pipeline", "stages": 1, "microbatches": 1, "compression": "powersgd",
     "compression_options": {"rank": 2}},
], ids=["dp-topk", "dp-powersgd", "zero1-topk", "pipeline-powersgd"])
def test_resumed_compressed_training_follows_the_uninterrupted_curve(comm, shared_dir, parallel):
    def go(name, steps, resume=False, ckpt=None):
        raw = _config(shared_dir, name, steps, parallel, resume)
        if ckpt:
            raw["checkpoint"]["dir"] = ckpt
        return run(validate(raw, name=name, world_size=comm.size), comm)

    go("straight", 6)
    half = os.path.join(shared_dir, "half-ckpt")
    go("half", 3, ckpt=half)
    go("resumed", 6, resume=True, ckpt=half)
    ref = _losses(os.path.join(shared_dir, "straight", "metrics.jsonl"))
    got = _losses(os.path.join(shared_dir, "resumed", "metrics.jsonl"))
    assert sorted(got) == [4, 5, 6]
    assert max(abs(got[s] - ref[s]) for s in got) < 1e-6, (got, ref)
