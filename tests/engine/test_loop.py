"""The training loop end to end in-process: p ranks give the curve one rank gives for the same
global batch, and the run leaves metrics and summary (the plot: test_train_job)."""
import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from mpidist.comm import Communicator
from mpidist.engine.config import validate
from mpidist.engine.loop import run
from mpidist.strategy.metrics import read_metrics


def _cfg(out_dir, cache_dir, plot):
    return validate({"job": {"steps": 10, "eval_every": 5, "progress": False, "plot": plot, "out_dir": out_dir,
                             "seed": 4},
                     "model": {"name": "mlp", "hidden": [16]},
                     "data": {"dataset": "synthetic", "samples": 300, "features": 12, "classes": 4,
                              "batch_size": 20, "cache_dir": cache_dir},
                     "optim": {"name": "lamb", "lr": 0.02, "schedule": "cosine", "warmup_steps": 3},
                     "parallel": {"strategy": "dp", "algorithm": "ring", "bucket_mb": 0.0001}}, name="loop")


def test_loop_on_p_ranks_matches_one_rank(comm, shared_dir):
    summary = run(_cfg(os.path.join(shared_dir, "dp"), os.path.join(shared_dir, "data"), plot=False), comm)
    solo = None
    if comm.rank == 0:            # the same job on one rank (collectives on COMM_SELF only)
        self_comm = Communicator(MPI.COMM_SELF)
        solo = run(_cfg(os.path.join(shared_dir, "solo"), os.path.join(shared_dir, "data1"), plot=False), self_comm)
        self_comm.free()
    comm.comm.Barrier()
    if comm.rank == 0:
        dp_rows = read_metrics(os.path.join(shared_dir, "dp", "metrics.jsonl"))
        solo_rows = read_metrics(os.path.join(shared_dir, "solo", "metrics.jsonl"))
        dp_loss = [r["loss"] for r in dp_rows if r["event"] == "step"]
        solo_loss = [r["loss"] for r in solo_rows if r["event"] == "step"]
        assert len(dp_loss) == 10 and np.allclose(dp_loss, solo_loss, rtol=1e-5, atol=1e-6)
        assert [r["step"] for r in dp_rows if r["event"] == "eval"] == [5, 10]
        assert abs(summary["test_accuracy"] - solo["test_accuracy"]) < 1e-9
        assert json.load(open(os.path.join(shared_dir, "dp", "summary.json")))["steps"] == 10
    assert summary["ranks"] == comm.size and summary["steps"] == 10


def test_a_setup_failure_on_one_rank_raises_on_every_rank(comm):
    from mpidist.engine.loop import JobFailed, agreed_call
    from mpidist.errors import ConfigError

    def fails_on_last(kind):
        if comm.rank == comm.size - 1:
            raise kind("broken on the last rank")
        return comm.rank

    assert agreed_call(comm, lambda: comm.rank) == comm.rank
    with pytest.raises(JobFailed, match=f"rank\\(s\\) {comm.size - 1}: OSError: broken"):
        agreed_call(comm, fails_on_last, OSError)
    with pytest.raises(ConfigError, match="broken on the last rank"):
        agreed_call(comm, fails_on_last, ConfigError)


def test_unknown_strategy_is_a_config_error_and_the_schema_lists_every_strategy(comm):
    from mpidist.engine.schema import SCHEMA
    from mpidist.engine.strategies import STRATEGIES, build_strategy
    from mpidist.strategy.base import Strategy
    from mpidist.errors import ConfigError
    cfg = _cfg("/tmp/unused", "/tmp/unused", plot=False)
    cfg["parallel"]["strategy"] = "warp"
    with pytest.raises(ConfigError, match="unknown parallel.strategy 'warp'"):
        build_strategy(cfg, comm, {})
    assert list(STRATEGIES) == ["dp", "zero", "pipeline", "ps", "admm", "diloco", "local_sgd",
                                "diloco_async"]
    assert all(issubclass(cls, Strategy) and cls.name == name for name, cls in STRATEGIES.items())
    assert SCHEMA["parallel"]["strategy"].choices == tuple(STRATEGIES)


def test_resume_mid_epoch_continues_the_same_curve(comm, shared_dir):
    """Checkpoint at step 6 (mid-epoch), resume to 10: the curve of a straight 10-step run."""
    def cfg(name, steps, resume):
        c = _cfg(os.path.join(shared_dir, name), os.path.join(shared_dir, "data"), plot=False)
        c["job"].update(steps=steps, eval_every=0)
        c["optim"].update(schedule="constant", warmup_steps=0)
        c["checkpoint"].update(interval=6, dir=os.path.join(shared_dir, name, "ckpt"), resume=resume)
        return c

    run(cfg("resumed", 6, False), comm)
    run(cfg("resumed", 10, True), comm)
    run(cfg("straight", 10, False), comm)
    if comm.rank == 0:
        a, b = (read_metrics(os.path.join(shared_dir, n, "metrics.jsonl")) for n in ("resumed", "straight"))
        assert [r["loss"] for r in a if r["event"] == "step"] == [r["loss"] for r in b if r["event"] == "step"]
        assert [r["step"] for r in a if r["event"] == "step"] == list(range(1, 11))
