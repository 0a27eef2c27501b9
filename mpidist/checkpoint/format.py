"""The on-disk format of an mpidist checkpoint, shared by the writer and the reader.

One HDF5 file per checkpoint:
  /                 attributes: format, format_version, mpidist_version, step, epoch,
                    world_size, created, hostname, checksum ("crc32"), scalars, meta,
                    rank_meta (JSON), tensors (JSON list of keys), meta_crc32
  /tensors/<key>    one dataset per global logical tensor, its full shape and dtype;
                    attributes: crc32 (of the row-major bytes), dtype, layout
                    (rows of [writer rank, offset, count]: who wrote what)
Plain `h5py.File(path)["tensors/params/fc1.weight"][...]` or `h5dump` reads it.
"""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
from h5py import h5s

from mpidist.checkpoint.crc import crc32
from mpidist.checkpoint.plan import flat_boxes

__all__ = ["FORMAT", "FORMAT_VERSION", "TENSORS", "CheckpointError",
           "CorruptCheckpointError", "IncompatibleCheckpointError", "storage_dtype", "logical_dtype", "check_key",
           "meta_checksum", "select_flat", "META_ATTRS"]

FORMAT = "mpidist-checkpoint"
FORMAT_VERSION = 1
TENSORS = "tensors"
# root attributes covered by meta_crc32 (JSON text or plain scalars)
META_ATTRS = ("format", "format_version", "mpidist_version", "step", "epoch", "world_size",
              "created", "hostname", "checksum", "scalars", "meta", "rank_meta", "tensors")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (raised on every rank)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is truncated, unreadable or fails its checksums."""


class IncompatibleCheckpointError(ValueError):
    """A checkpoint does not fit the model (tensors missing or of another shape)."""


def storage_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype HDF5 stores: native numeric types as they are, others (bfloat16, float8
    from ml_dtypes) as unsigned integers of the same width, named in the 'dtype' attribute."""
    dtype = np.dtype(dtype)
    if dtype.kind in "biuf" and type(dtype).__module__.startswith("numpy"):
        return dtype.newbyteorder("=")
    if dtype.kind == "V" and dtype.itemsize in (1, 2, 4, 8) and dtype.fields is None:
        return np.dtype(f"u{dtype.itemsize}")
    raise TypeError(f"cannot checkpoint dtype {dtype}: use a numeric dtype "
                    f"(float16/32/64, ints, bool, or ml_dtypes' bfloat16/float8)")


def logical_dtype(name: str) -> np.dtype:
    """The dtype recorded by name (resolving ml_dtypes names like 'bfloat16')."""
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def check_key(key) -> str:
    """A tensor key is a '/'-separated path of non-empty parts, e.g. 'optim/exp_avg/fc1.weight'."""
    if not isinstance(key, str):
        raise TypeError(f"tensor keys must be str, got {type(key).__name__}")
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"bad tensor key {key!r}: use '/'-separated non-empty names")
    return key


def to_json(value) -> str:
    try:
        return json.dumps(value, sort_keys=True, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"checkpoint metadata must be JSON-serialisable: {exc}") from None


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def _attr_text(value) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return repr(value.item())
    return repr(value) if not isinstance(value, str) else value


def meta_checksum(attrs) -> int:
    """CRC-32 over the root attributes in META_ATTRS (names and values, in order)."""
    text = "\n".join(f"{k}={_attr_text(attrs[k])}" for k in META_ATTRS if k in attrs)
    return crc32(text.encode())


def select_flat(dset_id, ranges):
    """A file dataspace of dataset dset_id selecting flat row-major (offset, count) ranges."""
    space = dset_id.get_space()
    space.select_none()
    shape = space.shape
    op = h5s.SELECT_SET
    for lo, n in ranges:
        if n and len(shape) == 0:
            space.select_all()
            continue
        for start, count in flat_boxes(lo, lo + n, shape):
            space.select_hyperslab(start, count, op=op)
            op = h5s.SELECT_OR
    return space


def memory_space(n: int):
    """A 1-D memory dataspace of n elements (all selected; none when n == 0)."""
    space = h5s.create_simple((max(n, 1),))
    if n == 0:
        space.select_none()
    return space
