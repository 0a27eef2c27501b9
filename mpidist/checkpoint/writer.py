"""The collective checkpoint writer: one parallel-HDF5 file, one dataset per global tensor,
every rank writing its own slices, atomically renamed into place (where h5py has no MPI,
the ranks write the same file in turns).

Input is a mapping key -> what this rank holds of that tensor: a whole array (a replicated
tensor: the ranks holding it split the writing among them) or a piece with .shape (the
global shape), .offset and .data (a contiguous slice of the row-major flattening), like
mpidist.engine.TensorPiece. Ranks may hold different keys (pipeline stages); together they
must cover every tensor they name.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
from math import prod

import h5py
import numpy as np
from h5py import h5fd, h5p

import mpidist
from mpidist import h5
from mpidist.checkpoint import format as fmt
from mpidist.checkpoint.crc import combine_pieces, crc32
from mpidist.checkpoint.plan import assign
from mpidist.comm import as_communicator
from mpidist.errors import agree_or_raise
from mpidist.kernels.backend import to_numpy

__all__ = ["write_checkpoint", "collective_io"]

_SPACE_MARGIN = 1.02          # room asked for beyond the tensor bytes (HDF5 metadata, slack)


def collective_io(comm) -> bool:
    """The default MPI-IO mode: collective when comm spans several nodes (see
    write_checkpoint), independent within one."""
    return as_communicator(comm).num_nodes > 1


def write_checkpoint(path: str, tensors, *, step: int, epoch: int | None = None,
                     scalars: dict | None = None,
                     meta: dict | None = None, rank_meta=None, comm=None,
                     collective: bool | None = None, fsync: bool = True) -> str:
    """Collective: write `tensors` to the HDF5 file `path`, atomically; returns path.

    step, epoch: where training stands; scalars: small JSON-able state the same on all
    ranks (optimizer step count, ...; rank 0's); meta: a JSON-able description (config,
    strategy, data-loader position, ...; rank 0's); rank_meta: JSON-able per-rank state
    (RNG states), stored as a list indexed by rank. collective: collective MPI-IO writes,
    or independent ones; default: collective when the ranks span several nodes, whose
    shared filesystem gains from two-phase I/O (fewer, aligned writers), independent
    within one node, where every write meets the same page cache and the aggregation's
    shuffle between ranks is only an extra copy (1 GiB on 4 ranks here: 1.9-2.0 s against
    2.3-2.8 s, best of 3).
    The file is written as `.<name>.tmp` in the same directory, flushed, fsync'ed and
    renamed, so `path` is either the previous file or the complete new one. A failure on any
    rank (bad input, full disk) raises CheckpointError/ValueError on every rank and leaves
    no partial file.
    """
    c = as_communicator(comm)
    if collective is None:
        collective = collective_io(c)
    # 1. local checks: what do I hold, is everything serialisable
    err, local = None, {}
    try:
        local = _local_pieces(tensors)
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rank_json = fmt.to_json(rank_meta)
        head = None
        if c.rank == 0:
            created = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}"
            head = (fmt.to_json(scalars or {}), fmt.to_json(meta or {}), created,
                    socket.gethostname(), None if epoch is None else int(epoch))
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank just below
        err, rank_json, head = exc, None, None
    agree_or_raise(c, err, fmt.CheckpointError)

    # 2. exchange what every rank holds; plan who writes which elements
    specs = c.comm.allgather({k: (p[0], p[1].name, p[2], p[3].size) for k, p in local.items()})
    rank_jsons = c.comm.allgather(rank_json)
    head = c.comm.bcast(head, root=0)
    table = _global_table(specs, c.size)
    my_step = c.comm.allgather(step)
    if len(set(my_step)) > 1:
        raise fmt.CheckpointError(f"ranks disagree on the step being saved: {my_step}")

    # 3. room on disk (checked before anything is touched: the previous checkpoint stays)
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp")
    nbytes = sum(prod(t["shape"]) * fmt.storage_dtype(t["dtype"]).itemsize for t in table.values())
    err = None
    if c.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            free = shutil.disk_usage(directory).free
            need = int(nbytes * _SPACE_MARGIN) + (1 << 20)
            if free < need:
                raise fmt.CheckpointError(
                    f"not enough disk space in {directory}: checkpoint needs {need / 2**30:.2f} GiB, "
                    f"{free / 2**30:.2f} GiB free; free space or point the checkpoint directory "
                    f"elsewhere (the previous checkpoint is untouched)")
            _reserve_probe(os.path.join(directory, f".{os.path.basename(path)}.reserve"), need)
        except Exception as exc:  # noqa: BLE001
            err = exc
    agree_or_raise(c, err, fmt.CheckpointError)

    # 4. write the temporary file collectively, then rename it into place
    try:
        _write_file(tmp, table, local, c, collective, step=step, head=head,
                    rank_jsons=rank_jsons)
        err = None
        try:
            if fsync and c.local_rank == 0:
                fsync_path(tmp)
        except OSError as exc:
            err = exc
        agree_or_raise(c, err, fmt.CheckpointError)
        if c.rank == 0:
            try:
                os.replace(tmp, path)
                if fsync:
                    fsync_path(directory)
            except OSError as exc:
                err = exc
        agree_or_raise(c, err, fmt.CheckpointError)
    except BaseException:
        if c.rank == 0 and os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def _local_pieces(tensors) -> dict:
    """key -> (global shape, dtype, flat offset, 1-D contiguous NumPy data) for what I hold."""
    if not hasattr(tensors, "items"):
        raise TypeError(f"tensors must be a mapping key -> array or piece, got {type(tensors).__name__}")
    out = {}
    for key, t in tensors.items():
        fmt.check_key(key)
        if hasattr(t, "offset") and hasattr(t, "data") and hasattr(t, "shape"):
            shape, offset, data = tuple(int(s) for s in t.shape), int(t.offset), t.data
        else:
            data = t
            shape, offset = tuple(int(s) for s in getattr(t, "shape", ())), 0
        data = np.ascontiguousarray(to_numpy(data)).reshape(-1)
        fmt.storage_dtype(data.dtype)
        if offset < 0 or offset + data.size > prod(shape):
            raise ValueError(f"tensor {key!r}: piece [{offset}, {offset + data.size}) lies outside "
                             f"its global shape {shape} ({prod(shape)} elements)")
        out[key] = (shape, data.dtype, offset, data)
    return out


def _global_table(specs: list[dict], size: int) -> dict:
    """key -> {shape, dtype, mine (per-rank ranges to write)}; the same on every rank.

    Holders must agree on shape and dtype, and together cover each tensor: otherwise the
    ValueError, computed from the same gathered specs, is raised on every rank.
    """
    keys = sorted({k for s in specs for k in s})
    problems, table = [], {}
    for key in keys:
        held = {r: s[key] for r, s in enumerate(specs) if key in s}
        kinds = {(v[0], v[1]) for v in held.values()}
        if len(kinds) > 1:
            detail = ", ".join(f"rank {r}: shape {v[0]} {v[1]}" for r, v in held.items())
            problems.append(f"{key}: ranks disagree ({detail})")
            continue
        shape, dtype = kinds.pop()
        claims = [[(held[r][2], held[r][3])] if r in held else [] for r in range(size)]
        mine, gaps = assign(claims, prod(shape))
        if gaps:
            problems.append(f"{key}: no rank holds elements {gaps[:3]}{'...' if len(gaps) > 3 else ''}")
            continue
        table[key] = {"shape": shape, "dtype": dtype, "mine": mine}
    leaves = set(keys)
    for key in keys:
        parts = key.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in leaves:
                problems.append(f"{key}: '{'/'.join(parts[:i])}' is also a tensor key")
    if problems:
        raise ValueError("cannot write checkpoint: " + "; ".join(problems))
    return table


def _write_file(tmp, table, local, c, collective, *, step, head, rank_jsons):
    """Create the file, write my ranges of every tensor, set the attributes: every rank at
    once through MPI-IO, or in turns where h5py has no MPI (_write_in_turns)."""
    if not h5.agreed_parallel_hdf5(c):
        return _write_in_turns(tmp, table, local, c, step=step, head=head,
                               rank_jsons=rank_jsons)

    dxpl = h5p.create(h5p.DATASET_XFER)
    if collective:
        dxpl.set_dxpl_mpio(h5fd.MPIO_COLLECTIVE)
    f, err = None, None
    try:
        f = h5py.File(tmp, "w", driver="mpio", comm=c.comm, libver="latest")
    except Exception as exc:  # noqa: BLE001
        err = exc
    agree_or_raise(c, err, fmt.CheckpointError)
    try:
        dsets = _create_datasets(f, table)    # collective: same order on every rank
        my_crcs = []
        for key, t in table.items():
            if prod(t["shape"]) == 0:             # no storage to write (same on all ranks)
                continue
            err = None
            try:
                my_crcs += _write_tensor(dsets[key], key, t, local.get(key), c.rank, dxpl)
            except Exception as exc:  # noqa: BLE001
                err = exc
            agree_or_raise(c, err, fmt.CheckpointError)
        crcs = _combine(c.comm.allgather(my_crcs), table)
        _set_attrs(f, dsets, table, crcs, c.size, step=step, head=head, rank_jsons=rank_jsons)
        f.flush()
    finally:
        err = None
        try:
            f.close()
        except Exception as exc:  # noqa: BLE001
            err = exc
    agree_or_raise(c, err, fmt.CheckpointError)


def _create_datasets(f, table) -> dict:
    """key -> the dataset of every tensor in table, created in f's tensors group."""
    group = f.create_group(fmt.TENSORS)
    return {key: group.create_dataset(key, shape=t["shape"], dtype=fmt.storage_dtype(t["dtype"]),
                                      fill_time="never")
            for key, t in table.items()}


def _write_in_turns(tmp, table, local, c, *, step, head, rank_jsons):
    """The same file without MPI-IO: rank 0 creates the datasets, then each rank in turn
    opens the file alone and writes its ranges, then rank 0 sets the attributes. As many
    writers as ranks, one at a time: slower than parallel HDF5, but the same bytes."""
    def on_rank(rank, mode, work):
        err = None
        if c.rank == rank:
            try:
                with h5py.File(tmp, mode, libver="latest") as f:
                    work(f)
            except Exception as exc:  # noqa: BLE001 - raised on every rank by agree_or_raise
                err = exc
        agree_or_raise(c, err, fmt.CheckpointError)

    my_crcs = []

    def write_mine(f):
        for key, t in table.items():
            if prod(t["shape"]) and t["mine"][c.rank]:
                my_crcs.extend(_write_tensor(f[fmt.TENSORS][key], key, t, local.get(key),
                                             c.rank, None))

    on_rank(0, "w", lambda f: _create_datasets(f, table))
    for rank in range(c.size):
        on_rank(rank, "r+", write_mine)
    crcs = _combine(c.comm.allgather(my_crcs), table)
    on_rank(0, "r+", lambda f: _set_attrs(
        f, {key: f[fmt.TENSORS][key] for key in table}, table, crcs, c.size, step=step,
        head=head, rank_jsons=rank_jsons))


def _write_tensor(dset, key, t, held, rank, dxpl):
    """Write my ranges of one tensor (an empty selection when I have none); their CRCs."""
    mine = t["mine"][rank]
    storage = fmt.storage_dtype(t["dtype"])
    if mine:
        _, _, offset, data = held
        parts = [data[lo - offset:lo - offset + n] for lo, n in mine]
        buf = (parts[0] if len(parts) == 1 else np.concatenate(parts)).view(storage)
    else:
        buf = np.empty(0, dtype=storage)
    dset.id.write(fmt.memory_space(buf.size), fmt.select_flat(dset.id, mine),
                  buf if buf.size else np.empty(1, dtype=storage), dxpl=dxpl)
    out, pos = [], 0
    for lo, n in mine:
        out.append((key, lo, n, crc32(buf[pos:pos + n])))
        pos += n
    return out


def _combine(gathered: list[list], table: dict) -> dict:
    """key -> (crc32 of the whole tensor, layout rows [rank, offset, count])."""
    pieces: dict = {k: [] for k in table}
    layout: dict = {k: [] for k in table}
    for r, rows in enumerate(gathered):
        for key, lo, n, value in rows:
            pieces[key].append((lo, n, value))
            layout[key].append((r, lo, n))
    out = {}
    for key, t in table.items():
        itemsize = fmt.storage_dtype(t["dtype"]).itemsize
        out[key] = (combine_pieces(pieces[key], itemsize, prod(t["shape"])),
                    np.array(sorted(layout[key], key=lambda row: row[1]), dtype=np.int64).reshape(-1, 3))
    return out


def _set_attrs(f, dsets, table, crcs, world_size, *, step, head, rank_jsons):
    """Identical attribute calls on every rank (parallel HDF5 requires it): values from rank 0."""
    scalars_json, meta_json, created, hostname, epoch = head
    for key, dset in dsets.items():
        dset.attrs["crc32"] = np.uint32(crcs[key][0])
        dset.attrs["dtype"] = table[key]["dtype"]
        dset.attrs["layout"] = crcs[key][1]
    a = f.attrs
    a["format"] = fmt.FORMAT
    a["format_version"] = fmt.FORMAT_VERSION
    a["mpidist_version"] = mpidist.__version__
    a["step"] = step
    if epoch is not None:
        a["epoch"] = epoch
    a["world_size"] = world_size
    a["created"] = created
    a["hostname"] = hostname
    a["checksum"] = "crc32"
    a["scalars"] = scalars_json
    a["meta"] = meta_json
    a["rank_meta"] = fmt.to_json([json.loads(s) for s in rank_jsons])
    a["tensors"] = fmt.to_json(sorted(table))
    a["meta_crc32"] = np.uint32(fmt.meta_checksum(a))


def _reserve_probe(probe: str, nbytes: int) -> None:
    """Allocate nbytes in a scratch file, then free them: quotas, file-size limits and a disk
    that statvfs reports roomier than it is fail here, before HDF5 has touched anything
    (a parallel HDF5 write that fails half-way cannot always close its file cleanly)."""
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise fmt.CheckpointError(
            f"cannot reserve {nbytes / 2**30:.2f} GiB for the checkpoint in "
            f"{os.path.dirname(probe)}: {exc.strerror or exc}; free space or raise the quota "
            f"(the previous checkpoint is untouched)") from None
    finally:
        os.close(fd)
        os.remove(probe)


def fsync_path(path: str) -> None:
    """fsync a file or directory by path (a directory: makes a rename durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
