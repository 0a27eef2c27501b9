"""Training state as pieces of global tensors: what every strategy's state_dict() returns
and what checkpoints write and read, below both (mpidist.checkpoint does not import engine).

A StateDict holds, per key ("params/<name>", "optim/<state>/<name>", run state such as
"compress/..."), a TensorPiece: the tensor's full shape and this rank's contiguous 1-D
slice of its row-major flattening. Over the ranks the pieces of a tensor are disjoint and
cover it once (a replicated tensor is split by chunk()), so a parallel writer writes every
byte once. A load source has .step, .scalars, .keys(), .shape(key) and
.read(key, offset, count), whatever world size wrote it. See docs/ARCHITECTURE.md
("Strategy" and "Checkpoints").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mpidist.kernels.backend import get_array_module, to_numpy

__all__ = ["TensorPiece", "StateDict", "InMemoryState", "MODEL_PREFIXES", "flat_pieces",
           "replicated_pieces", "read_flat", "read_params", "assemble_state", "gather_state"]

# Key prefixes of the model's logical tensors, which every checkpoint must hold; other keys
# are run state (compression residuals, ps clocks), loaded when present.
MODEL_PREFIXES = ("params/", "optim/")


@dataclass
class TensorPiece:
    """This rank's slice [offset, offset + data.size) of a global tensor's row-major flattening."""
    shape: tuple
    offset: int
    data: np.ndarray

    @property
    def dtype(self):
        return self.data.dtype


@dataclass
class StateDict:
    """step, the pieces this rank holds (key -> TensorPiece) and JSON-able scalars (same on all ranks)."""
    step: int
    tensors: dict = field(default_factory=dict)
    scalars: dict = field(default_factory=dict)


class InMemoryState:
    """A load_state_dict source over whole arrays held in memory: {key: array of full shape}."""

    def __init__(self, step: int, tensors: dict, scalars: dict | None = None):
        self.step = int(step)
        self.tensors = {k: np.asarray(v) for k, v in tensors.items()}
        self.scalars = dict(scalars or {})

    def keys(self):
        return self.tensors.keys()

    def shape(self, key: str) -> tuple:
        return self._get(key).shape

    def read(self, key: str, offset: int, count: int) -> np.ndarray:
        return self._get(key).reshape(-1)[offset:offset + count]

    def _get(self, key: str) -> np.ndarray:
        if key not in self.tensors:
            raise KeyError(f"state has no tensor {key!r}; it has {sorted(self.tensors)[:8]}...")
        return self.tensors[key]


def flat_pieces(prefix: str, layout, arr, lo: int) -> dict:
    """Pieces of the layout's tensors held in arr, which covers global flat range [lo, lo+len(arr))."""
    out = {}
    for index, start, stop in layout.clip(lo, lo + len(arr)):
        seg = layout.segments[index]
        out[f"{prefix}/{seg.name}"] = TensorPiece(seg.shape, start - seg.offset, to_numpy(arr[start - lo:stop - lo]))
    return out


def replicated_pieces(prefix: str, layout, flat, rank: int, size: int) -> dict:
    """Pieces of a buffer every rank holds whole: rank writes chunk(numel, rank, size) of it."""
    lo, count = layout.shard(rank, size)
    return flat_pieces(prefix, layout, flat[lo:lo + count], lo)


def read_flat(source, prefix: str, layout, out, lo: int = 0) -> None:
    """Fill out (global flat range [lo, lo+len(out))) from source's "<prefix>/<name>" tensors."""
    xp = get_array_module(out)
    for index, start, stop in layout.clip(lo, lo + len(out)):
        seg = layout.segments[index]
        key = f"{prefix}/{seg.name}"
        if tuple(source.shape(key)) != seg.shape:
            raise ValueError(f"checkpoint tensor {key} has shape {tuple(source.shape(key))}, "
                             f"the model expects {seg.shape}")
        piece = source.read(key, start - seg.offset, stop - start)
        out[start - lo:stop - lo] = xp.asarray(piece, dtype=out.dtype)


def read_params(source, layout, out, lo: int = 0) -> None:
    """read_flat of the parameters: from the fp32 masters ("optim/master/<name>") where a
    mixed-precision run wrote them, since its "params/" are rounded to 16 bits; else "params/"."""
    keys = set(source.keys())
    masters = all(f"optim/master/{seg.name}" in keys for seg in layout.segments)
    read_flat(source, "optim/master" if masters else "params", layout, out, lo)


def assemble_state(step: int, pieces, scalars: dict | None = None) -> InMemoryState:
    """Whole tensors from pieces of them: pieces holds one {key: TensorPiece} per holder
    (ranks, copies); where two pieces overlap they hold the same values."""
    tensors: dict = {}
    shapes: dict = {}
    for held in pieces:
        for key, p in held.items():
            full = tensors.setdefault(key, np.zeros(int(np.prod(p.shape)), dtype=p.data.dtype))
            full[p.offset:p.offset + p.data.size] = p.data.reshape(-1)
            shapes[key] = p.shape
    return InMemoryState(step, {k: v.reshape(shapes[k]) for k, v in tensors.items()}, scalars)


def gather_state(sd: StateDict, comm) -> InMemoryState:
    """Collective: assemble every tensor whole on every rank (small models, tests)."""
    return assemble_state(sd.step, comm.comm.allgather(sd.tensors), sd.scalars)
