"""The checkpoint reader: opens one file on every rank, verifies it, and serves any slice of
any tensor to any rank, so a checkpoint written by p ranks loads on q (resharding on read).

It is a load_state_dict source as mpidist.strategy.base describes: .step, .scalars,
.shape(key), .read(key, offset, count).
"""
from __future__ import annotations

import json
import os
from math import prod

import h5py
import numpy as np

from mpidist.checkpoint import format as fmt
from mpidist.checkpoint.crc import combine_pieces, crc32
from mpidist.comm import as_communicator
from mpidist.errors import agree_or_raise
from mpidist.h5 import open_file
from mpidist.partition import chunk

__all__ = ["CheckpointReader", "open_checkpoint", "inspect_checkpoint"]

_VERIFY_BLOCK = 32 << 20      # bytes read at a time while verifying


def inspect_checkpoint(path: str) -> dict:
    """One process, no MPI: the root attributes and tensor table of a checkpoint file.

    Raises CorruptCheckpointError if the file is missing, truncated, not an mpidist
    checkpoint, or its metadata fails its checksum. Data checksums are not read here.
    """
    try:
        with h5py.File(path, "r") as f:
            a = f.attrs
            if a.get("format") != fmt.FORMAT:
                raise fmt.CorruptCheckpointError(f"{path} is not an mpidist checkpoint "
                                                 f"(format attribute {a.get('format')!r})")
            if int(a["format_version"]) > fmt.FORMAT_VERSION:
                raise fmt.CorruptCheckpointError(
                    f"{path} has format version {int(a['format_version'])}; this mpidist reads "
                    f"up to {fmt.FORMAT_VERSION}: upgrade mpidist")
            if int(a["meta_crc32"]) != fmt.meta_checksum(a):
                raise fmt.CorruptCheckpointError(f"{path}: metadata checksum mismatch")
            keys = json.loads(a["tensors"])
            tensors = {}
            for key in keys:
                d = f[f"{fmt.TENSORS}/{key}"]
                tensors[key] = {"shape": tuple(int(s) for s in d.shape),
                                "dtype": str(d.attrs["dtype"]),
                                "crc32": int(d.attrs["crc32"]),
                                "layout": np.asarray(d.attrs["layout"])}
            return {"path": os.path.abspath(path), "step": int(a["step"]),
                    "epoch": int(a["epoch"]) if "epoch" in a else None,
                    "world_size": int(a["world_size"]), "mpidist_version": str(a["mpidist_version"]),
                    "created": str(a["created"]), "scalars": json.loads(a["scalars"]),
                    "meta": json.loads(a["meta"]), "rank_meta": json.loads(a["rank_meta"]),
                    "tensors": tensors}
    except fmt.CorruptCheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise fmt.CorruptCheckpointError(f"{path} is unreadable (truncated or damaged?): "
                                         f"{type(exc).__name__}: {exc}") from None


def open_checkpoint(path: str, *, comm=None, verify: bool = True) -> "CheckpointReader":
    """Collective: open (and by default verify) a checkpoint on every rank of comm."""
    return CheckpointReader(path, comm=comm, verify=verify)


class CheckpointReader:
    """An open checkpoint. Collective to open and close; read() is per rank, any slice.

    verify: every rank checksums its chunk() of every tensor and the pieces are combined
    into whole-tensor CRCs compared with the stored ones (independent of the writer's world
    size). A bad file raises CorruptCheckpointError on every rank.
    """

    def __init__(self, path: str, *, comm=None, verify: bool = True):
        self.comm = as_communicator(comm)
        c = self.comm
        self.path = os.path.abspath(path)
        # 1. rank 0 reads the metadata alone (a damaged file fails here, on every rank)
        info, err = None, None
        if c.rank == 0:
            try:
                info = inspect_checkpoint(self.path)
            except fmt.CorruptCheckpointError as exc:
                err = str(exc)
        info, err = c.comm.bcast((info, err), root=0)
        if err is not None:
            raise fmt.CorruptCheckpointError(err)
        self.info = info
        self.step: int = info["step"]
        self.epoch = info["epoch"]
        self.scalars: dict = info["scalars"]
        self.meta: dict = info["meta"]
        self.rank_meta: list = info["rank_meta"]
        self.world_size: int = info["world_size"]
        self.tensors: dict = info["tensors"]
        # 2. everyone opens it (with MPI-IO where h5py has it)
        self._file = None
        try:
            self._file = open_file(self.path, "r", c)
        except Exception as exc:  # noqa: BLE001
            err = fmt.CorruptCheckpointError(f"{self.path} does not open: "
                                             f"{type(exc).__name__}: {exc}")
        agree_or_raise(c, err, fmt.CorruptCheckpointError)
        if verify:
            try:
                self.verify()
            except BaseException:
                self.close()
                raise

    # ---------------------------------------------------------------- the source contract
    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key) -> bool:
        return key in self.tensors

    def shape(self, key: str) -> tuple:
        return self._entry(key)["shape"]

    def dtype(self, key: str) -> np.dtype:
        return fmt.logical_dtype(self._entry(key)["dtype"])

    def read(self, key: str, offset: int = 0, count: int | None = None) -> np.ndarray:
        """Elements [offset, offset + count) of the tensor's row-major flattening (1-D).

        count defaults to the rest of the tensor. Per rank, not collective.
        """
        entry = self._entry(key)
        numel = prod(entry["shape"])
        offset = int(offset)
        count = numel - offset if count is None else int(count)
        if offset < 0 or count < 0 or offset + count > numel:
            raise ValueError(f"{key}: range [{offset}, {offset + count}) outside its "
                             f"{numel} elements (shape {entry['shape']})")
        dset = self._dataset(key)
        storage = dset.dtype
        out = np.empty(max(count, 1), dtype=storage)
        if count:
            dset.id.read(fmt.memory_space(count), fmt.select_flat(dset.id, [(offset, count)]), out)
        return out[:count].view(self.dtype(key))

    def read_full(self, key: str) -> np.ndarray:
        """The whole tensor in its shape (per rank)."""
        return self.read(key).reshape(self.shape(key))

    def read_chunk(self, key: str) -> tuple[int, np.ndarray]:
        """(offset, data) of my chunk() of the tensor's flattening, for this reader's world."""
        offset, count = chunk(prod(self.shape(key)), self.comm.rank, self.comm.size)
        return offset, self.read(key, offset, count)

    # ---------------------------------------------------------------- checks
    def verify(self, keys=None) -> None:
        """Collective: check the CRC-32 of every tensor (or of `keys`) from per-rank chunks."""
        c = self.comm
        keys = sorted(self.tensors if keys is None else keys)
        mine, err = [], None
        try:
            for key in keys:
                entry = self._entry(key)
                numel = prod(entry["shape"])
                offset, count = chunk(numel, c.rank, c.size)
                itemsize = self._dataset(key).dtype.itemsize
                step = max(1, _VERIFY_BLOCK // itemsize)
                value = 0
                for lo in range(offset, offset + count, step):
                    n = min(step, offset + count - lo)
                    value = crc32(self.read(key, lo, n).view(np.uint8), value)
                mine.append((key, offset, count, value))
        except Exception as exc:  # noqa: BLE001
            err = exc
        agree_or_raise(c, err if err is None else fmt.CorruptCheckpointError(
            f"{self.path}: reading tensor data failed: {type(err).__name__}: {err}"),
            fmt.CorruptCheckpointError)
        pieces: dict = {k: [] for k in keys}
        for rows in c.comm.allgather(mine):
            for key, offset, count, value in rows:
                pieces[key].append((offset, count, value))
        bad = []
        for key in keys:
            itemsize = self._dataset(key).dtype.itemsize
            got = combine_pieces(pieces[key], itemsize, prod(self.shape(key)))
            if got != self.tensors[key]["crc32"]:
                bad.append(key)
        if bad:
            raise fmt.CorruptCheckpointError(
                f"{self.path}: checksum mismatch in {len(bad)} tensor(s): {', '.join(bad[:8])}"
                f"{' ...' if len(bad) > 8 else ''}")

    def require(self, shapes: dict) -> None:
        """Refuse a checkpoint that does not fit: every key in `shapes` must be present with
        that shape. The same answer on every rank (pass the same dict everywhere)."""
        missing = sorted(k for k in shapes if k not in self.tensors)
        wrong = sorted(f"{k} (checkpoint {self.tensors[k]['shape']}, expected {tuple(s)})"
                       for k, s in shapes.items()
                       if k in self.tensors and tuple(self.tensors[k]["shape"]) != tuple(s))
        if missing or wrong:
            parts = []
            if wrong:
                parts.append(f"shapes differ for {len(wrong)} tensor(s): {'; '.join(wrong[:8])}")
            if missing:
                parts.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}")
            raise fmt.IncompatibleCheckpointError(
                f"checkpoint {self.path} does not fit this model: {' | '.join(parts)}. "
                f"Resume with the model configuration it was written with.")

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Collective: close the file."""
        if self._file is not None:
            f, self._file = self._file, None
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _entry(self, key: str) -> dict:
        if key not in self.tensors:
            raise KeyError(f"checkpoint {self.path} has no tensor {key!r} "
                           f"(it has {len(self.tensors)}: {', '.join(sorted(self.tensors)[:6])} ...)")
        return self.tensors[key]

    def _dataset(self, key: str):
        if self._file is None:
            raise RuntimeError("the checkpoint is closed; open it again with open_checkpoint()")
        return self._file[f"{fmt.TENSORS}/{key}"]
