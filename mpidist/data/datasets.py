"""Datasets stored as HDF5, read with parallel HDF5: each rank reads only the rows it uses.

File layout (written by mpidist.data.importers):
    /train/x, /train/y, /test/x, /test/y      classification (x float32 rows, y int64 labels)
    /train/tokens, /test/tokens               language model (uint8 byte stream)
    attributes on "/": kind ("classification" | "lm"), source, and classes + in_shape
    (classification) or vocab (lm).

A dataset answers `read(indices) -> (x, y)` for sample indices in any order; rows are fetched
in increasing order (what HDF5 selections need) and put back in the asked order.
See docs/ARCHITECTURE.md (data).
"""
from __future__ import annotations

import json

import h5py
import numpy as np

from mpidist.h5 import open_file

__all__ = ["ArrayDataset", "H5Dataset", "H5TextDataset", "open_dataset"]


class _Closing:
    """Datasets are context managers: closing a parallel HDF5 file is collective."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ArrayDataset(_Closing):
    """In-memory arrays with the dataset interface (synthetic benchmarks, tests)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, meta: dict):
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} rows but y has {len(y)}")
        self.x, self.y, self.meta = x, y, dict(meta)
        self.n = len(x)

    def read(self, indices):
        """(x, y) of the given rows."""
        return self.x[indices], self.y[indices]

    def close(self):
        """Nothing to release (in memory)."""
        pass


class H5Dataset(_Closing):
    """One split ("train" / "test") of a classification HDF5 file."""

    def __init__(self, path: str, split: str = "train", comm=None):
        self.file = open_file(path, "r", comm)
        if split not in self.file:
            raise ValueError(f"{path} has no split {split!r}; it has {list(self.file)}")
        self.x, self.y = self.file[split]["x"], self.file[split]["y"]
        self.n = int(self.x.shape[0])
        attrs = self.file.attrs
        self.meta = {"kind": "classification", "classes": int(attrs["classes"]),
                     "in_shape": tuple(int(s) for s in json.loads(attrs["in_shape"])),
                     "source": str(attrs.get("source", path)), "n": self.n}

    def read(self, indices):
        """(x, y) of the given rows, read from the file (any order; sorted reads inside)."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size == 0:
            return (np.empty((0, *self.x.shape[1:]), self.x.dtype), np.empty(0, self.y.dtype))
        rows, inverse = np.unique(indices, return_inverse=True)    # HDF5 selections increase
        return self.x[rows][inverse], self.y[rows][inverse]

    def close(self):
        """Close the file."""
        self.file.close()


class H5TextDataset(_Closing):
    """Byte-level LM samples: sample i is tokens[i*block : i*block + block + 1] (inputs, next bytes)."""

    def __init__(self, path: str, split: str = "train", block: int = 64, comm=None):
        self.file = open_file(path, "r", comm)
        if split not in self.file:
            raise ValueError(f"{path} has no split {split!r}; it has {list(self.file)}")
        self.tokens = self.file[split]["tokens"]
        self.block = int(block)
        self.n = (int(self.tokens.shape[0]) - 1) // self.block
        if self.n < 1:
            raise ValueError(f"{path}/{split} has {self.tokens.shape[0]} tokens: too few for block {block}")
        self.meta = {"kind": "lm", "vocab": int(self.file.attrs["vocab"]), "block": self.block,
                     "source": str(self.file.attrs.get("source", path)), "n": self.n}

    def read(self, indices):
        """(x, y): the block+1-byte windows starting at the given offsets, y shifted by one."""
        indices = np.asarray(indices, dtype=np.int64)
        b = self.block
        win = np.empty((len(indices), b + 1), dtype=np.int64)
        for row, i in enumerate(indices):      # one contiguous slice per sample
            win[row] = self.tokens[i * b:i * b + b + 1]
        return win[:, :-1], win[:, 1:]

    def close(self):
        """Close the file."""
        self.file.close()


def open_dataset(path: str, split: str, comm=None, block: int | None = None):
    """The right reader for an mpidist HDF5 dataset file (by its `kind` attribute)."""
    with h5py.File(path, "r") as fh:
        kind = str(fh.attrs.get("kind", ""))
    if kind == "classification":
        return H5Dataset(path, split, comm)
    if kind == "lm":
        return H5TextDataset(path, split, block or 64, comm)
    raise ValueError(f"{path} is not an mpidist dataset (attribute kind={kind!r}); "
                     "write one with mpidist.data.importers")
