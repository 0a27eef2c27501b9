"""Gradient-compression state in checkpoints, as global datasets.

A CompressedAllreduce keeps one compressor per gradient bucket; its error-feedback residual
differs from rank to rank, its other arrays (PowerSGD's Q) and counters do not. Each of the
R data-parallel replicas that share a bucket writes row r of (R, ...) datasets:
compress/residual/<tensor> per parameter tensor (so they load whatever the bucketing), and
compress/bucket/<first tensor>/<name> for every other array and number of the compressor's
state_dict(). restore_compression loads them at the same or another replica count (its
docstring gives the rules); the key table is in docs/ARCHITECTURE.md ("Checkpoints").
"""
from __future__ import annotations

import numbers

import numpy as np

from mpidist.kernels.backend import to_numpy
from mpidist.state import TensorPiece

__all__ = ["compression_pieces", "compression_scalars", "restore_compression", "RESIDUAL", "BUCKET"]

RESIDUAL = "compress/residual"
BUCKET = "compress/bucket"


def _bucket_segments(layout, offset: int, count: int):
    """The layout segments of bucket [offset, offset + count); it must start at a tensor."""
    segs = [layout.segments[i] for i, _, _ in layout.clip(offset, offset + count)]
    if not segs or segs[0].offset != offset:
        raise ValueError(f"compression bucket [{offset}, {offset + count}) does not start at a "
                         f"tensor of the layout; buckets hold whole tensors")
    return segs


def compression_pieces(ca, layout, replica: int, replicas: int) -> dict:
    """This replica's rows of the compression datasets of `ca` (a CompressedAllreduce over
    the gradients of `layout`), as {key: TensorPiece}."""
    out = {}
    sd = ca.state_dict()
    for (offset, count), calls, csd in sd["buffers"]:
        segs = _bucket_segments(layout, offset, count)
        prefix = f"{BUCKET}/{segs[0].name}"
        counters = {"length": count, "calls": calls}
        for name, value in csd.items():
            if name == "config" or value is None:
                continue
            if name == "residual":
                flat = np.asarray(value, dtype=np.float32).reshape(-1)
                for seg in segs:
                    lo = seg.offset - offset
                    out[f"{RESIDUAL}/{seg.name}"] = TensorPiece(
                        (replicas, *seg.shape), replica * seg.size, flat[lo:lo + seg.size])
            elif hasattr(value, "shape"):
                flat = np.ascontiguousarray(to_numpy(value)).reshape(-1)
                out[f"{prefix}/{name}"] = TensorPiece((replicas, flat.size), replica * flat.size, flat)
            elif isinstance(value, numbers.Number):
                counters[name] = value
            else:
                raise TypeError(f"compressor state {name!r} ({type(value).__name__}) cannot be "
                                f"checkpointed: give it as an array or a number")
        for name, value in counters.items():
            dtype = np.float64 if isinstance(value, (float, np.floating)) else np.int64
            out[f"{prefix}/{name}"] = TensorPiece((replicas,), replica, np.array([value], dtype=dtype))
    return out


def compression_scalars(ca) -> dict:
    """What every replica shares: the compressor's config and the call counters."""
    return {"config": ca.compressor.config(), "step": ca.step, "skipped_steps": ca.skipped_steps}


def restore_compression(ca, source, layout, buckets, replica: int, replicas: int) -> None:
    """Load ca's state for `buckets` ([(offset, count)] of its gradient buffer) from source,
    as replica `replica` of `replicas`. Per rank.

    - the same number of replicas: each replica reads its own rows back, exactly;
    - R old replicas onto R' new ones: every new residual is (1/R') * the sum of the old
      ones. Gradients are summed over replicas, so what error feedback still owes the
      updates is the sum of the residuals; spread evenly it stays the same sum (the
      replicas' residuals are alike, so none is favoured). Other arrays take the mean of
      the old rows (exact for PowerSGD's Q, which every rank shares); counters row 0;
    - no compression state in the checkpoint: residuals start at zero; a checkpoint of
      another compressor (other config): its residuals only.
    """
    keys = set(source.keys())
    saved = source.scalars.get("compression") or {}
    config = ca.compressor.config()
    same = saved.get("config") == config
    buffers = []
    for offset, count in buckets:
        segs = _bucket_segments(layout, offset, count)
        prefix = f"{BUCKET}/{segs[0].name}"
        csd = {"config": config, "step": 0,
               "residual": _residual(source, keys, segs, count, replica, replicas)
               if ca.compressor.error_feedback else None}
        calls = 0
        if same and f"{prefix}/length" in keys and _row(source, f"{prefix}/length", replica, replicas) == count:
            for key in sorted(k for k in keys if k.startswith(prefix + "/")):
                name = key[len(prefix) + 1:]
                if len(source.shape(key)) == 1:
                    value = _row(source, key, replica, replicas)
                    if name == "calls":
                        calls = int(value)
                    elif name != "length":
                        csd[name] = value.item()
                else:
                    csd[name] = _rows(source, key, replica, replicas, np.mean)
        buffers.append([[offset, count], calls, csd])
    ca.load_state_dict({"step": int(saved.get("step", 0)) if same else 0,
                        "skipped_steps": int(saved.get("skipped_steps", 0)) if same else 0,
                        "total_bytes_sent": 0, "buffers": buffers})


def _residual(source, keys, segs, count, replica, replicas):
    """The bucket's residual for this replica; None when the checkpoint holds none of it."""
    found = [seg for seg in segs if f"{RESIDUAL}/{seg.name}" in keys]
    if not found:
        return None
    out = np.zeros(count, dtype=np.float32)
    base = segs[0].offset
    for seg in found:
        key = f"{RESIDUAL}/{seg.name}"
        if tuple(source.shape(key)[1:]) != seg.shape:
            raise ValueError(f"checkpoint tensor {key} has rows of shape {tuple(source.shape(key)[1:])}, "
                             f"the model's {seg.name} is {seg.shape}")
        out[seg.offset - base:seg.stop - base] = _rows(source, key, replica, replicas,
                                                       lambda rows, axis: rows.sum(axis) / replicas)
    return out


def _rows(source, key, replica, replicas, combine):
    """My row of a (R, ...) dataset when R == replicas, else combine(all rows, axis=0)."""
    shape = tuple(source.shape(key))
    width = int(np.prod(shape[1:], dtype=np.int64))
    if shape[0] == replicas:
        return np.array(source.read(key, replica * width, width))
    rows = np.asarray(source.read(key, 0, shape[0] * width)).reshape(shape[0], width)
    return combine(rows.astype(np.float64), axis=0).astype(rows.dtype)


def _row(source, key, replica, replicas):
    """A counter: my entry at the same replica count, else the first replica's."""
    return source.read(key, replica if source.shape(key)[0] == replicas else 0, 1)[0]
