"""From the [data] config section to datasets, and the batches of one epoch on this rank.

See docs/ARCHITECTURE.md (data).
"""
from __future__ import annotations

import os

from mpidist.data.datasets import H5Dataset, H5TextDataset, open_dataset
from mpidist.data.importers import import_digits, import_text, make_synthetic

__all__ = ["build_datasets", "iterate"]


def build_datasets(config: dict, comm):
    """Collective: write the HDF5 file if needed, open train and test splits on every rank.

    Returns (train, test, meta); meta is the train split's metadata plus n_train / n_test.
    """
    d, seed = config["data"], config["job"]["seed"]
    cache = d["cache_dir"]
    kind = d["dataset"]
    if kind == "digits":
        path = import_digits(os.path.join(cache, f"digits_s{seed}_t{d['test_fraction']}.h5"),
                             test_fraction=d["test_fraction"], seed=seed, comm=comm)
    elif kind == "synthetic":
        name = f"synthetic_{d['samples']}x{d['features']}_c{d['classes']}_s{seed}_t{d['test_fraction']}.h5"
        path = make_synthetic(os.path.join(cache, name), samples=d["samples"], features=d["features"],
                              classes=d["classes"], test_fraction=d["test_fraction"], seed=seed, comm=comm)
    elif kind == "text":
        stem = os.path.splitext(os.path.basename(d["path"]))[0]
        path = import_text(d["path"], os.path.join(cache, f"text_{stem}_t{d['test_fraction']}.h5"),
                           test_fraction=d["test_fraction"], comm=comm)
    else:
        path = d["path"]
    if kind == "text":
        train, test = (H5TextDataset(path, s, d["block"], comm) for s in ("train", "test"))
    elif kind == "hdf5":
        train, test = (open_dataset(path, s, comm, d["block"]) for s in ("train", "test"))
    else:
        train, test = (H5Dataset(path, s, comm) for s in ("train", "test"))
    meta = dict(train.meta, n_train=train.n, n_test=test.n, path=path)
    return train, test, meta


def iterate(dataset, sampler, start: int = 0):
    """Yield (x, y, global batch size) for this rank over the sampler's current epoch,
    from batch `start` on (the batches before it are not read)."""
    for b, (count, idx) in enumerate(sampler):
        if b < start:
            continue
        if sampler.rank is None:
            yield None, None, count
        else:
            x, y = dataset.read(idx)
            yield x, y, count
