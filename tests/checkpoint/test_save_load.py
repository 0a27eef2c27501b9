"""Checkpoint write / read on the ranks of this run (any N): round trips of replicated,
sharded and single-owner tensors, resharding on read, verification and fallback, refusal
of incompatible checkpoints, full disks, and the preemption flag."""
import os
import resource
import shutil
import signal
import subprocess

import h5py
import ml_dtypes
import numpy as np
import pytest

from mpidist.checkpoint import (CheckpointError, CheckpointManager, CorruptCheckpointError,
                                IncompatibleCheckpointError, Preemption, inspect_checkpoint,
                                open_checkpoint, write_checkpoint)
from mpidist.checkpoint import writer as writer_module
from mpidist.comm import Communicator
from mpidist.partition import chunk


class Piece:
    def __init__(self, shape, offset, data):
        self.shape, self.offset, self.data = shape, offset, data


def global_tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "params/fc1.weight": rng.standard_normal((13, 7)).astype(np.float32),
        "params/fc1.bias": rng.standard_normal(7).astype(np.float16),
        "optim/exp_avg/fc1.weight": rng.standard_normal((13, 7)),
        "master/bf16": rng.standard_normal((5, 3)).astype(ml_dtypes.bfloat16),
        "ps/clock": np.array(42, dtype=np.int64),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def my_pieces(full, rank, size):
    """Replicated, ZeRO-sharded (reversed ranks: uneven, out of order) and rank-0-only tensors."""
    out = {"params/fc1.weight": full["params/fc1.weight"], "empty": full["empty"]}
    for key in ("params/fc1.bias", "optim/exp_avg/fc1.weight", "master/bf16"):
        t = full[key]
        o, c = chunk(t.size, size - 1 - rank, size)
        out[key] = Piece(t.shape, o, t.reshape(-1)[o:o + c])
    if rank == 0:
        out["ps/clock"] = full["ps/clock"]
    return out


def test_round_trip_and_reshard(comm, shared_dir):
    full = global_tensors()
    path = os.path.join(shared_dir, "a.h5")
    write_checkpoint(path, my_pieces(full, comm.rank, comm.size), step=11, epoch=2,
                     scalars={"loader": [3, 5]}, meta={"config": {"lr": 0.1}},
                     rank_meta={"rank": comm.rank}, comm=comm)
    with open_checkpoint(path, comm=comm) as src:
        assert src.step == 11 and src.epoch == 2 and src.world_size == comm.size
        assert src.scalars == {"loader": [3, 5]}
        assert src.meta == {"config": {"lr": 0.1}}
        assert src.rank_meta == [{"rank": r} for r in range(comm.size)]
        assert sorted(src.keys()) == sorted(full)
        for key, t in full.items():
            got = src.read_full(key)
            assert got.dtype == t.dtype and got.shape == t.shape, key
            assert got.tobytes() == t.tobytes(), key
            offset, part = src.read_chunk(key)           # resharded for this world
            o, c = chunk(t.size, comm.rank, comm.size)
            assert offset == o and np.array_equal(part, t.reshape(-1)[o:o + c]), key
        assert np.array_equal(src.read("optim/exp_avg/fc1.weight", 20, 9),
                              full["optim/exp_avg/fc1.weight"].reshape(-1)[20:29])
    # self-describing: a plain, single-process h5py sees every tensor and the layout
    if comm.rank == 0:
        with h5py.File(path, "r") as f:
            assert np.array_equal(f["tensors/params/fc1.weight"][...], full["params/fc1.weight"])
            layout = f["tensors/optim/exp_avg/fc1.weight"].attrs["layout"]
            assert sorted(layout[:, 0]) == list(range(comm.size)) and layout[:, 2].sum() == 91
        # ... and so does HDF5's own h5dump (Debian's hdf5-tools, installed by setup_env.sh)
        dump = subprocess.run(["h5dump", "-m", "%.9g", "-d", "/tensors/params/fc1.weight", path],
                              capture_output=True, text=True, timeout=60)
        assert dump.returncode == 0, dump.stderr
        assert "DATASPACE  SIMPLE { ( 13, 7 ) / ( 13, 7 ) }" in dump.stdout
        first = float(dump.stdout.split("(0,0):")[1].split(",")[0])
        assert first == pytest.approx(float(full["params/fc1.weight"][0, 0]), rel=1e-6)
    assert not any(name.endswith(".tmp") for name in os.listdir(shared_dir))


def test_independent_io_gives_the_same_file_content(comm, shared_dir):
    full = global_tensors(1)
    paths = [os.path.join(shared_dir, f"{m}.h5") for m in ("coll", "ind")]
    for path, collective in zip(paths, (True, False)):
        write_checkpoint(path, my_pieces(full, comm.rank, comm.size), step=1, comm=comm,
                         collective=collective)
    a, b = (inspect_checkpoint(p)["tensors"] for p in paths)
    assert {k: v["crc32"] for k, v in a.items()} == {k: v["crc32"] for k, v in b.items()}


def test_without_mpi_io_the_ranks_write_the_same_file_in_turns(comm, shared_dir, monkeypatch):
    """Without MPI-IO (an h5py built without MPI, or MPIDIST_HDF5_MPIO=0): the ranks write
    in turns and read on their own; the file holds the same bytes as the parallel write's,
    and reads back whole and resharded."""
    full = global_tensors(2)
    parallel, turns = (os.path.join(shared_dir, f"{m}.h5") for m in ("parallel", "turns"))
    write_checkpoint(parallel, my_pieces(full, comm.rank, comm.size), step=3, comm=comm)
    monkeypatch.setenv("MPIDIST_HDF5_MPIO", "0")
    used = []
    real = writer_module._write_in_turns
    monkeypatch.setattr(writer_module, "_write_in_turns",
                        lambda *a, **k: used.append(1) or real(*a, **k))
    write_checkpoint(turns, my_pieces(full, comm.rank, comm.size), step=3,
                     rank_meta={"rank": comm.rank}, comm=comm)
    assert used == [1]
    a, b = (inspect_checkpoint(p)["tensors"] for p in (parallel, turns))
    assert {k: v["crc32"] for k, v in a.items()} == {k: v["crc32"] for k, v in b.items()}
    with open_checkpoint(turns, comm=comm) as src:
        assert src.step == 3 and src.rank_meta == [{"rank": r} for r in range(comm.size)]
        for key, t in full.items():
            assert src.read_full(key).tobytes() == t.tobytes(), key
            offset, part = src.read_chunk(key)
            o, c = chunk(t.size, comm.rank, comm.size)
            assert offset == o and np.array_equal(part, t.reshape(-1)[o:o + c]), key


@pytest.mark.parametrize("ranks_per_node", [None, 1])
def test_io_mode_defaults_to_collective_across_nodes_only(comm, shared_dir, monkeypatch,
                                                          ranks_per_node):
    topo = Communicator(comm.comm, ranks_per_node=ranks_per_node)
    seen = []
    real = writer_module._write_file
    monkeypatch.setattr(writer_module, "_write_file",
                        lambda *a, **k: seen.append(a[4]) or real(*a, **k))
    path = os.path.join(shared_dir, f"io{ranks_per_node}.h5")
    write_checkpoint(path, my_pieces(global_tensors(), comm.rank, comm.size), step=1, comm=topo)
    assert seen == [topo.num_nodes > 1] == [writer_module.collective_io(topo)]
    with open_checkpoint(path, comm=topo) as src:
        assert src.step == 1
    topo.free()


def test_manager_keeps_last_k_and_falls_back_over_damaged_files(comm, shared_dir):
    mgr = CheckpointManager(shared_dir, keep=3, comm=comm)
    assert mgr.open_latest() is None
    full = global_tensors(2)
    for step in (1, 2, 3, 4):
        mgr.save(step, my_pieces(full, comm.rank, comm.size), epoch=step)
    assert mgr.steps() == [2, 3, 4]
    mgr.save(5, my_pieces(full, comm.rank, comm.size))
    assert mgr.steps() == [3, 4, 5]
    # a flipped byte in step 4's data and a truncated step 5: both reported, step 3 used
    if comm.rank == 0:
        with h5py.File(mgr.path(4), "r") as f:
            where = f["tensors/optim/exp_avg/fc1.weight"].id.get_offset() + 17
        with open(mgr.path(4), "r+b") as fh:
            fh.seek(where)
            byte = fh.read(1)
            fh.seek(where)
            fh.write(bytes([byte[0] ^ 0x10]))
        size = os.path.getsize(mgr.path(5))
        with open(mgr.path(5), "r+b") as fh:
            fh.truncate(size // 2)
    comm.comm.Barrier()
    with pytest.warns(RuntimeWarning) if comm.rank == 0 else _nothing():
        src = mgr.open_latest()
    with src:
        assert src.step == 3
        assert np.array_equal(src.read_full("master/bf16"), full["master/bf16"])
    reasons = dict(mgr.skipped)
    assert "checksum mismatch" in reasons[mgr.path(4)]
    assert "optim/exp_avg/fc1.weight" in reasons[mgr.path(4)]
    assert mgr.path(5) in reasons
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        open_checkpoint(mgr.path(4), comm=comm)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_incompatible_checkpoint_is_refused_naming_tensors(comm, shared_dir):
    path = os.path.join(shared_dir, "m.h5")
    write_checkpoint(path, my_pieces(global_tensors(), comm.rank, comm.size), step=1, comm=comm)
    with open_checkpoint(path, comm=comm) as src:
        with pytest.raises(IncompatibleCheckpointError) as info:
            src.require({"params/fc1.weight": (13, 8), "params/fc1.bias": (7,),
                         "params/fc2.weight": (3, 3)})
        assert "params/fc1.weight (checkpoint (13, 7), expected (13, 8))" in str(info.value)
        assert "params/fc2.weight" in str(info.value) and "fc1.bias" not in str(info.value)


def test_bad_input_fails_on_every_rank(comm, shared_dir):
    path = os.path.join(shared_dir, "bad.h5")
    # holders disagree on the shape of one tensor
    shape = (4, 4) if comm.rank == comm.size - 1 and comm.size > 1 else (16,)
    with pytest.raises(ValueError, match="ranks disagree" if comm.size > 1 else "no rank holds"):
        held = np.ones(16) if comm.size > 1 else Piece((17,), 0, np.ones(16))
        write_checkpoint(path, {"w": Piece(shape, 0, held) if comm.size > 1 else held},
                         step=1, comm=comm)
    # one rank passes something unserialisable
    bad_meta = object() if comm.rank == comm.size - 1 else {}
    with pytest.raises((TypeError, CheckpointError), match="JSON-serialisable"):
        write_checkpoint(path, {"w": np.ones(3)}, step=1, rank_meta=bad_meta, comm=comm)
    assert not os.path.exists(path)


def test_full_disk_leaves_previous_checkpoint_intact(comm, shared_dir, monkeypatch):
    mgr = CheckpointManager(shared_dir, keep=3, comm=comm)
    small = {"w": np.arange(1000, dtype=np.float64)}
    mgr.save(1, small)
    big = {"w": np.arange(1000, dtype=np.float64),
           "big": Piece((comm.size * 400_000,), comm.rank * 400_000, np.ones(400_000))}
    # 1. the space check: too little room is refused before anything is written
    if comm.rank == 0:
        monkeypatch.setattr(writer_module.shutil, "disk_usage",
                            lambda d: shutil._ntuple_diskusage(10**9, 10**9 - 10**5, 10**5))
    with pytest.raises(CheckpointError, match="not enough disk space"):
        mgr.save(2, big)
    monkeypatch.undo()
    # 2. a limit statvfs does not show (here a file-size limit: EFBIG) is found by reserving
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(CheckpointError, match="cannot reserve"):
            mgr.save(2, big)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert mgr.steps() == [1]
    comm.comm.Barrier()
    assert sorted(os.listdir(shared_dir)) == ["ckpt-00000001.h5"]
    with mgr.open_latest() as src:
        assert src.step == 1 and np.array_equal(src.read("w"), small["w"])


def test_preemption_flag_is_agreed_by_every_rank(comm):
    with Preemption(comm, signals=("SIGUSR1",)) as pre:
        assert not pre.should_stop()
        if comm.rank == comm.size - 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        assert pre.requested == (comm.rank == comm.size - 1)
        assert pre.should_stop()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    with pytest.raises(ValueError, match="unknown signal"):
        Preemption(comm, signals=("SIGNOPE",))


class _Strategy:
    """The part of the engine's Strategy contract the checkpoint hook uses."""

    def __init__(self, comm, n=10):
        self.comm, self.step, self.w = comm, 0, np.zeros(n)

    def state_dict(self):
        from mpidist.state import StateDict, TensorPiece
        o, c = chunk(self.w.size, self.comm.rank, self.comm.size)
        return StateDict(self.step, {"params/w": TensorPiece((self.w.size,), o, self.w[o:o + c])},
                         {"optim_step": self.step})

    def load_state_dict(self, source):
        self.w = source.read("params/w").copy()
        self.step = source.step


def test_training_hook_saves_resumes_and_stops_on_signal(comm, shared_dir):
    from mpidist.checkpoint.hook import CheckpointHook
    config = {"checkpoint": {"dir": shared_dir, "interval": 2, "keep": 2},
              "job": {"steps_per_epoch": 4, "seed": 0}, "parallel": {"strategy": "toy"}}
    hook = CheckpointHook(config, comm)
    s = _Strategy(comm)
    try:
        assert hook.resume(s) is False
        for _ in range(3):                       # steps 1..3: saved at 2
            s.step += 1
            s.w += s.step
            hook.after_step(s, last=False)
        np.random.seed(1234 + comm.rank)         # the RNG state step 4 saves, per rank
        assert hook.manager.steps() == [2]
        if comm.rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        s.step += 1
        s.w += s.step
        with pytest.raises(SystemExit) as stop:  # every rank: saves step 4, exits 75
            hook.after_step(s, last=False)
        assert stop.value.code == 75
    finally:
        hook.close()
    assert hook.manager.steps() == [2, 4]
    info = inspect_checkpoint(hook.manager.path(4))
    assert info["epoch"] == 1 and info["meta"]["loader"] == {"epoch": 1, "batch": 0, "seed": 0}
    assert info["scalars"] == {"optim_step": 4}
    # a new run (same world size) resumes the tensors, the step and each rank's RNG
    np.random.seed(99)
    again = _Strategy(comm)
    hook = CheckpointHook(config, comm)
    try:
        assert hook.resume(again) is True
    finally:
        hook.close()
    assert again.step == 4 and np.array_equal(again.w, np.full(10, 10.0))
    assert np.array_equal(np.random.rand(3), np.random.RandomState(1234 + comm.rank).rand(3))
    with pytest.raises(IncompatibleCheckpointError, match="params/w"):
        hook = CheckpointHook(config, comm)
        try:
            hook.resume(_Strategy(comm, n=12))
        finally:
            hook.close()


def test_mpio_switch_is_agreed_by_every_rank(comm, shared_dir, monkeypatch):
    """MPIDIST_HDF5_MPIO takes 0 or 1; set on one rank only, every rank takes the path
    without MPI-IO (no rank waits in a collective open the others skip); a bad value on
    one rank raises on all."""
    from mpidist.h5 import agreed_parallel_hdf5, parallel_hdf5
    monkeypatch.setenv("MPIDIST_HDF5_MPIO", "1")
    assert parallel_hdf5() is h5py.get_config().mpi
    if comm.rank == 0:
        monkeypatch.setenv("MPIDIST_HDF5_MPIO", "0")
    assert agreed_parallel_hdf5(comm) is False
    path = os.path.join(shared_dir, "mixed.h5")
    write_checkpoint(path, my_pieces(global_tensors(), comm.rank, comm.size), step=1, comm=comm)
    with open_checkpoint(path, comm=comm) as src:
        assert src.read_full("params/fc1.weight").tobytes() == \
            global_tensors()["params/fc1.weight"].tobytes()
    if comm.rank == comm.size - 1:
        monkeypatch.setenv("MPIDIST_HDF5_MPIO", "no")
    with pytest.raises(ValueError, match="MPIDIST_HDF5_MPIO must be 0 or 1, got 'no'"):
        agreed_parallel_hdf5(comm)
