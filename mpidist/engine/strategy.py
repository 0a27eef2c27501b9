"""Strategy: one way of spreading a training step over ranks, and the registry the loop uses.

The training loop (mpidist.engine.loop) knows nothing about how a step is parallelised; it
asks the registry for `config["parallel"]["strategy"]` and drives the object it gets:

    strategy = build_strategy(config, comm, meta)     # collective over comm
    for each step:  metrics = strategy.train_step(x, y, global_count=B)
    strategy.evaluate(x, y); strategy.state_dict(); strategy.load_state_dict(src)

Each part registers a "module:factory" string (imported only when chosen), so the ZeRO,
pipeline and parameter-server code plugs in without editing the loop:

    STRATEGIES = {"dp": "mpidist.engine.dp:DataParallel", "zero": "mpidist.zero.strategy:ZeroStrategy", ...}

A factory is called as factory(config, comm, meta) and returns a Strategy; a class whose
__init__ has that signature is its own factory.

Data contract. Every global batch is split by rows over data-parallel replicas: the rank
with `data_rank = r` of `data_size` replicas receives rows chunk(B, r, data_size) of it
(several ranks may share one data_rank, e.g. the stages of one pipeline replica); a rank
with `data_rank = None` receives x = y = None (a parameter server). Every rank calls
train_step once per step, so collective calls stay matched.

State contract (what the checkpoint writer reads). state_dict() returns a StateDict whose
tensors are *pieces of global logical tensors*: key "params/<name>" or
"optim/<state>/<name>", the tensor's full shape, and this rank's contiguous 1-D slice of its
row-major flattening at `offset`. Over the ranks of strategy.comm the pieces of each tensor
are disjoint and cover it exactly once (a replicated tensor is split by chunk()), so a
parallel HDF5 writer writes every byte once. load_state_dict(source) pulls what this rank
needs through source.read(key, offset, count), whatever world size wrote it.
Keys under MODEL_PREFIXES ("params/", "optim/") are the model's logical tensors: a
checkpoint must hold every one the strategy has to be loaded. Other keys are run state
("compress/..." residuals, "ps/..." clocks): loaded when present, started afresh when not
(a checkpoint written without them, or by another strategy).
"""
from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field

import numpy as np

from mpidist.errors import ConfigError
from mpidist.kernels.backend import get_array_module, to_numpy
from mpidist.partition import chunk

__all__ = ["Strategy", "StateDict", "TensorPiece", "InMemoryState", "STRATEGIES", "register_strategy",
           "build_strategy", "strategy_factory", "flat_pieces", "replicated_pieces", "read_flat", "read_params",
           "gather_state", "build_model_from_config", "build_optimizer_from_config", "lr_schedule",
           "build_compression", "METRIC_KEYS", "MODEL_PREFIXES"]

# Keys every train_step result has (values identical on all ranks except the t_* timings).
METRIC_KEYS = ("loss", "correct", "count", "t_compute", "t_comm", "t_optim")

# Key prefixes of the tensors every checkpoint must hold (the rest is optional run state).
MODEL_PREFIXES = ("params/", "optim/")

STRATEGIES: dict[str, str] = {
    "dp": "mpidist.engine.dp:DataParallel",
    "zero": "mpidist.zero.strategy:ZeroStrategy",
    "pipeline": "mpidist.pipeline.strategy:PipelineStrategy",
    "ps": "mpidist.ps.strategy:ParameterServerStrategy",
    "admm": "mpidist.admm:ADMMStrategy",
}


def register_strategy(name: str, target: str) -> None:
    """Map a [parallel] strategy name to "package.module:factory"."""
    if not isinstance(name, str) or not name:
        raise TypeError("strategy name must be a non-empty string")
    if not isinstance(target, str) or target.count(":") != 1:
        raise ValueError(f"strategy target must look like 'package.module:factory', got {target!r}")
    STRATEGIES[name] = target


def strategy_factory(name: str):
    """Import and return the factory registered for name (ConfigError if it cannot be had)."""
    if name not in STRATEGIES:
        raise ConfigError(f"unknown parallel.strategy {name!r}; choose one of {sorted(STRATEGIES)}")
    module, attr = STRATEGIES[name].split(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"parallel.strategy {name!r} is not available in this installation "
                          f"({module} cannot be imported: {exc})") from None
    if not hasattr(mod, attr):
        raise ConfigError(f"parallel.strategy {name!r}: {module} has no {attr}")
    return getattr(mod, attr)


def build_strategy(config: dict, comm, meta: dict) -> "Strategy":
    """Collective: build the configured strategy on every rank of comm."""
    factory = strategy_factory(config["parallel"]["strategy"])
    strategy = factory(config, comm, meta)
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy factory for {config['parallel']['strategy']!r} returned "
                        f"{type(strategy).__name__}, not a Strategy")
    return strategy


# ---------------------------------------------------------------------------- state
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


def gather_state(sd: StateDict, comm) -> InMemoryState:
    """Collective: assemble every tensor whole on every rank (small models, tests)."""
    everything = comm.comm.allgather({k: (p.shape, p.offset, p.data) for k, p in sd.tensors.items()})
    tensors: dict = {}
    for pieces in everything:
        for key, (shape, offset, data) in pieces.items():
            full = tensors.setdefault(key, np.zeros(int(np.prod(shape)), dtype=data.dtype))
            full[offset:offset + data.size] = data
    shapes = {k: s for pieces in everything for k, (s, _, _) in pieces.items()}
    return InMemoryState(sd.step, {k: v.reshape(shapes[k]) for k, v in tensors.items()}, sd.scalars)


# ---------------------------------------------------------------------------- builders
def build_model_from_config(config: dict, meta: dict):
    """The [model] section plus the sizes the dataset dictates (meta) -> an mpidist.nn model."""
    from mpidist.engine.config import MODEL_KEYS
    from mpidist.nn import build_model, data_kwargs

    name = config["model"]["name"]
    kw = {k: config["model"][k] for k in MODEL_KEYS[name]}
    if "dropout" in kw:
        kw["seed"] = config["job"]["seed"]
    return build_model(name, **kw, **data_kwargs(name, meta))


def lr_schedule(config: dict):
    """The [optim] learning rate: a number, or a schedule callable(step) over job.total_steps."""
    o = config["optim"]
    if o["schedule"] == "constant" and o["warmup_steps"] == 0:
        return o["lr"]
    from mpidist.optim.lr_schedules import build_lr_schedule

    total = max(config["job"]["total_steps"], o["warmup_steps"])
    return build_lr_schedule(o["schedule"], o["lr"], total, warmup_steps=o["warmup_steps"], end_lr=o["end_lr"])


def build_optimizer_from_config(config: dict, layout, offset: int = 0, count: int | None = None):
    """The [optim] section -> mpidist.optim optimizer over global elements [offset, offset+count).

    Needs config["job"]["total_steps"], which the training loop fills in before it builds
    the strategy (it depends on the dataset size).
    """
    from mpidist.optim import build_optimizer

    o = config["optim"]
    return build_optimizer(o["name"], layout, lr=lr_schedule(config), **o["hyper"], offset=offset, count=count)


def build_compression(config: dict, comm):
    """[parallel] compression, compression_options, compression_warmup, compression_allreduce
    -> the CompressedAllreduce averaging gradients over comm (collective use), or None when
    compression = "none". nonfinite="skip": an inf/NaN gradient comes back NaN on every rank
    (residuals untouched), so the optimizer step that follows skips everywhere."""
    p = config["parallel"]
    if p["compression"] == "none":
        return None
    from mpidist.compress import CompressedAllreduce, make_compressor

    compressor = make_compressor(p["compression"], **p.get("compression_options", {}))
    return CompressedAllreduce(compressor, comm, algorithm=p.get("compression_allreduce", "auto"),
                               warmup_steps=p.get("compression_warmup", 0), nonfinite="skip")


# ---------------------------------------------------------------------------- the interface
class Strategy(abc.ABC):
    """Base class of dp / zero / pipeline / ps / admm.

    config: the validated job config (plain nested dict, every key present, see engine.config),
      plus config["job"]["total_steps"] filled in by the loop;
    comm: the mpidist Communicator of the whole job; meta: the dataset's metadata
    ({"kind": "classification", "in_shape", "classes"} or {"kind": "lm", "vocab", "block"}).
    Subclasses set data_rank / data_size if their data split is not one replica per rank.
    """
    name = "base"

    def __init__(self, config: dict, comm, meta: dict):
        self.config = config
        self.comm = comm
        self.meta = meta
        self.data_rank: int | None = comm.rank
        self.data_size: int = comm.size
        self.step = 0

    def shard_rows(self, batch_size: int) -> tuple[int, int]:
        """(offset, count) of this rank's rows in a global batch (count 0 when it reads none)."""
        if self.data_rank is None:
            return 0, 0
        return chunk(batch_size, self.data_rank, self.data_size)

    @abc.abstractmethod
    def train_step(self, x, y, global_count: int | None = None) -> dict:
        """One optimisation step on this rank's rows of the global batch.

        global_count: samples in the whole global batch (the loop knows it from the sampler;
        the loss is the mean over them). Returns at least METRIC_KEYS: loss (global mean),
        correct and count (global sums; tokens for a language model), and this rank's
        t_compute / t_comm / t_optim in seconds. Must increment self.step.
        """

    @abc.abstractmethod
    def evaluate(self, x, y) -> dict:
        """Loss summed, correct and count over the global evaluation batch (same on all ranks)."""

    @abc.abstractmethod
    def state_dict(self) -> StateDict:
        """This rank's pieces of the global tensors (see the module docstring)."""

    @abc.abstractmethod
    def load_state_dict(self, source) -> None:
        """Collective: restore from a source with .step, .scalars, .shape(key), .read(key, offset, count)."""

    @abc.abstractmethod
    def memory_report(self) -> dict:
        """Bytes this rank holds: {"params", "grads", "optim", "activations"(if known), "total"}."""

    def close(self) -> None:
        """Release communicators or threads the strategy made (collective)."""
