"""Sampler coverage at any world size, parallel-HDF5 shard reads, importers (real MPI ranks)."""
import os

import numpy as np
import pytest

from mpidist.data import (DistributedSampler, H5Dataset, H5TextDataset, epoch_order, import_digits, import_text,
                          iterate, make_synthetic)
from mpidist.errors import RemoteError

SAMPLE_TEXT = os.path.join(os.path.dirname(__file__), "..", "..", "data", "sample.txt")


@pytest.mark.parametrize("n,batch,drop_last", [(23, 5, True), (23, 5, False), (7, 7, True), (9, 4, False)])
def test_sampler_same_global_batches_at_every_world_size(n, batch, drop_last):
    """Concatenating the ranks' rows of each batch gives the same global batch for sizes 1..6."""
    reference = None
    for size in range(1, 7):
        samplers = [DistributedSampler(n, batch, rank=r, size=size, seed=3, drop_last=drop_last) for r in range(size)]
        for s in samplers:
            s.set_epoch(2)
        per_rank = [list(s) for s in samplers]
        glob = [np.concatenate([per_rank[r][b][1] for r in range(size)]) for b in range(len(samplers[0]))]
        counts = {per_rank[r][b][0] for r in range(size) for b in range(len(glob))}
        assert all(per_rank[r][b][0] == len(glob[b]) for r in range(size) for b in range(len(glob)))
        if reference is None:
            reference = glob
        assert len(glob) == len(reference) and all(np.array_equal(a, b) for a, b in zip(glob, reference))
        assert counts <= {batch, n % batch}
    used = np.concatenate(reference)
    expected = (n // batch) * batch if drop_last else n
    assert len(used) == expected and len(np.unique(used)) == expected


def test_epoch_order_reshuffles_per_epoch_and_repeats_per_seed():
    a, b = epoch_order(50, 1, 0), epoch_order(50, 1, 1)
    assert not np.array_equal(a, b) and np.array_equal(np.sort(a), np.arange(50))
    assert np.array_equal(a, epoch_order(50, 1, 0))
    assert np.array_equal(epoch_order(50, 1, 4, shuffle=False), np.arange(50))


def test_sampler_errors():
    with pytest.raises(ValueError, match="drop_last"):
        DistributedSampler(10, 11)
    with pytest.raises(ValueError, match="outside"):
        DistributedSampler(10, 2, rank=3, size=3)


@pytest.mark.parametrize("drop_last", [True, False])
def test_mpi_shards_cover_the_dataset_exactly_once(comm, drop_last):
    """Over one epoch the ranks' indices, gathered, are each used sample exactly once."""
    n, batch = 101, 2 * comm.size + 3
    sampler = DistributedSampler(n, batch, rank=comm.rank, size=comm.size, seed=5, drop_last=drop_last)
    sampler.set_epoch(1)
    mine = [idx for _, idx in sampler]
    everyone = np.concatenate([np.concatenate(m) for m in comm.comm.allgather(mine)])
    expected = (n // batch) * batch if drop_last else n
    assert len(everyone) == expected and len(np.unique(everyone)) == expected
    order = epoch_order(n, 5, 1)
    assert set(everyone.tolist()) == set(order[:expected].tolist())


def test_digits_parallel_hdf5_read(comm, shared_dir):
    """Each rank reads its rows with the MPI-IO driver; together they are the training split."""
    path = import_digits(os.path.join(shared_dir, "digits.h5"), test_fraction=0.25, seed=1, comm=comm)
    train, test = H5Dataset(path, "train", comm), H5Dataset(path, "test", comm)
    assert train.meta["classes"] == 10 and train.meta["in_shape"] == (1, 8, 8)
    assert train.n + test.n == 1797
    sampler = DistributedSampler(train.n, 64, rank=comm.rank, size=comm.size, seed=0, drop_last=False)
    rows = [(x, y) for x, y, _ in iterate(train, sampler)]
    xs = np.concatenate([x for x, _ in rows])
    ys = np.concatenate([y for _, y in rows])
    assert xs.dtype == np.float32 and xs.shape[1] == 64 and 0 <= xs.min() and xs.max() <= 1
    gathered = comm.comm.gather((xs, ys), root=0)
    n_train, train_y = train.n, train.y[:]
    train.close()                 # collective: before any rank-dependent assertion
    test.close()
    if comm.rank == 0:            # scikit-learn is slow to import: one rank checks against it
        from sklearn.datasets import load_digits
        all_x = np.concatenate([x for x, _ in gathered])
        all_y = np.concatenate([y for _, y in gathered])
        digits = load_digits()
        ref = (digits.data / 16.0).astype(np.float32)
        key = {row.tobytes(): i for i, row in enumerate(ref)}
        # every training image read once, each with scikit-learn's label for it
        assert len(all_x) == n_train and all(r.tobytes() in key for r in all_x)
        assert np.array_equal(np.bincount(all_y, minlength=10), np.bincount(train_y, minlength=10))
        assert all(digits.target[key[x.tobytes()]] == y for x, y in zip(all_x, all_y))


def test_reads_without_mpi_io_equal_the_parallel_reads(comm, shared_dir, monkeypatch):
    """Without MPI-IO (MPIDIST_HDF5_MPIO=0, or an h5py built without MPI), each rank opens
    the file on its own (plain driver) and reads the same rows as through MPI-IO."""
    path = import_digits(os.path.join(shared_dir, "digits.h5"), test_fraction=0.25, seed=1, comm=comm)
    idx = np.arange(comm.rank, 1000, 7 + comm.size)[::-1]
    with H5Dataset(path, "train", comm) as ds:
        parallel = ds.read(idx)
        driver = ds.file.driver
    monkeypatch.setenv("MPIDIST_HDF5_MPIO", "0")
    with H5Dataset(path, "train", comm) as ds:
        plain = ds.read(idx)
        assert ds.file.driver == "sec2"
    assert driver == ("mpio" if comm.size > 1 else "sec2")
    assert all(np.array_equal(a, b) for a, b in zip(parallel, plain))


def test_synthetic_is_deterministic_and_sized(comm, shared_dir):
    p1 = make_synthetic(os.path.join(shared_dir, "s1.h5"), samples=40, features=5, classes=3, seed=2, comm=comm)
    p2 = make_synthetic(os.path.join(shared_dir, "s2.h5"), samples=40, features=5, classes=3, seed=2, comm=comm)
    with H5Dataset(p1, "train", comm) as a, H5Dataset(p2, "train", comm) as b:
        idx = np.array([5, 0, 17, 3])
        xa, ya = a.read(idx)
        xb, yb = b.read(idx)
        reversed_x = a.read(idx[::-1])[0]
        repeated_x = a.read(np.array([3, 3, 0]))[0]
        n = a.n
    assert np.array_equal(xa, xb) and np.array_equal(ya, yb) and xa.shape == (4, 5)
    assert np.array_equal(reversed_x, xa[::-1])       # asked order is kept
    assert np.array_equal(repeated_x, xa[[3, 3, 1]])
    assert n == 32


def test_text_dataset_windows(comm, shared_dir):
    path = import_text(SAMPLE_TEXT, os.path.join(shared_dir, "text.h5"), comm=comm)
    with H5TextDataset(path, "train", block=16, comm=comm) as ds:
        meta, n = ds.meta, ds.n
        x, y = ds.read(np.array([3, 0]))
    assert meta["vocab"] == 256 and n > 100
    with open(SAMPLE_TEXT, "rb") as fh:
        raw = np.frombuffer(fh.read(), dtype=np.uint8)
    assert np.array_equal(x[1], raw[:16]) and np.array_equal(y[1], raw[1:17])
    assert np.array_equal(x[0], raw[48:64])


def test_import_failure_raises_on_every_rank(comm, shared_dir):
    missing = os.path.join(shared_dir, "no-such.txt")
    with pytest.raises((FileNotFoundError, RemoteError)):
        import_text(missing if comm.rank == 0 else SAMPLE_TEXT, os.path.join(shared_dir, "t.h5"), comm=comm)


def test_iterate_from_a_later_batch_reads_only_those():
    from mpidist.data import ArrayDataset

    class Counting(ArrayDataset):
        reads = 0

        def read(self, indices):
            Counting.reads += 1
            return super().read(indices)

    ds = Counting(np.arange(20.0)[:, None], np.arange(20), {})
    sampler = DistributedSampler(20, 4, seed=1)
    full = [y for _, y, _ in iterate(ds, sampler)]
    Counting.reads = 0
    tail = [y for _, y, _ in iterate(ds, sampler, start=3)]
    assert Counting.reads == 2 and all(np.array_equal(a, b) for a, b in zip(full[3:], tail))
