"""Writers of mpidist HDF5 datasets: scikit-learn's bundled digits (no download), a synthetic
classification set of any size, and a byte-level corpus from any text file.

Each writer is collective over comm: rank 0 writes (to a temporary name, then renames), the
others wait, and a failure on rank 0 is raised on every rank. A file already written with the
same arguments is reused (its `params` attribute records them).
See docs/ARCHITECTURE.md (data).
"""
from __future__ import annotations

import json
import os

import h5py
import numpy as np

__all__ = ["import_digits", "make_synthetic", "import_text", "synthetic_arrays", "split_indices"]


def split_indices(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded random train/test split of range(n), each part in increasing order."""
    perm = np.random.default_rng(seed).permutation(n)
    n_test = max(1, int(round(n * test_fraction)))
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def synthetic_arrays(samples: int, features: int, classes: int, seed: int = 0):
    """Gaussian clusters: class c is centred at a random unit-variance point; x float32, y int64."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 1.0, (classes, features)).astype(np.float32)
    y = rng.integers(0, classes, samples).astype(np.int64)
    x = centres[y] + rng.normal(0.0, 1.5, (samples, features)).astype(np.float32)
    return x, y


def _collective_write(path: str, params, write, comm) -> str:
    """Rank 0 runs write(h5 file) unless path already holds these params; all ranks wait.

    params: a dict, or a callable returning one (evaluated on rank 0, inside the agreement).
    """
    error = None
    if comm is None or comm.rank == 0:
        try:
            params_json = json.dumps(params() if callable(params) else params, sort_keys=True)
            if not _up_to_date(path, params_json):
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                tmp = f"{path}.tmp{os.getpid()}"
                with h5py.File(tmp, "w") as fh:
                    write(fh)
                    fh.attrs["params"] = params_json
                os.replace(tmp, path)
        except Exception as exc:  # raised on every rank below
            error = exc
    if comm is not None:
        comm.raise_if_any(error)
    elif error is not None:
        raise error
    return path


def _up_to_date(path: str, params_json: str) -> bool:
    if not os.path.exists(path):
        return False
    try:
        with h5py.File(path, "r") as fh:
            return fh.attrs.get("params") == params_json
    except OSError:
        return False


def _write_classification(fh, x, y, train, test, classes, in_shape, source):
    for split, idx in (("train", train), ("test", test)):
        g = fh.create_group(split)
        g.create_dataset("x", data=x[idx].astype(np.float32))
        g.create_dataset("y", data=y[idx].astype(np.int64))
    fh.attrs.update(kind="classification", classes=int(classes), in_shape=json.dumps(list(in_shape)), source=source)


def import_digits(path: str, *, test_fraction: float = 0.2, seed: int = 0, comm=None) -> str:
    """scikit-learn's 1797 8x8 handwritten digits (bundled, no download), pixels scaled to [0, 1]."""
    def write(fh):
        from sklearn.datasets import load_digits       # optional: only this importer needs it
        d = load_digits()
        x = (d.data / 16.0).astype(np.float32)
        train, test = split_indices(len(x), test_fraction, seed)
        _write_classification(fh, x, d.target, train, test, 10, (1, 8, 8), "sklearn.datasets.load_digits")
    return _collective_write(path, {"dataset": "digits", "test_fraction": test_fraction, "seed": seed}, write, comm)


def make_synthetic(path: str, *, samples: int, features: int, classes: int, test_fraction: float = 0.2,
                   seed: int = 0, comm=None) -> str:
    """A synthetic_arrays() dataset of any size, split into train/test."""
    def write(fh):
        x, y = synthetic_arrays(samples, features, classes, seed)
        train, test = split_indices(samples, test_fraction, seed)
        _write_classification(fh, x, y, train, test, classes, (features,), "synthetic")
    params = {"dataset": "synthetic", "samples": samples, "features": features, "classes": classes,
              "test_fraction": test_fraction, "seed": seed}
    return _collective_write(path, params, write, comm)


def import_text(text_path: str, path: str, *, test_fraction: float = 0.1, comm=None) -> str:
    """The bytes of any text file as a token stream (vocab 256); the last fraction is the test split."""
    def write(fh):
        with open(text_path, "rb") as src:
            data = np.frombuffer(src.read(), dtype=np.uint8)
        if len(data) < 100:
            raise ValueError(f"{text_path} has only {len(data)} bytes; give the LM a longer text")
        cut = int(len(data) * (1 - test_fraction))
        fh.create_group("train").create_dataset("tokens", data=data[:cut])
        fh.create_group("test").create_dataset("tokens", data=data[cut:])
        fh.attrs.update(kind="lm", vocab=256, source=os.path.basename(text_path))
    def params():
        stat = os.stat(text_path)
        return {"dataset": "text", "source": os.path.abspath(text_path), "bytes": stat.st_size,
                "mtime": stat.st_mtime_ns, "test_fraction": test_fraction}
    return _collective_write(path, params, write, comm)
