"""Per-rank memory accounting of model states, measured from the arrays actually allocated.

The ZeRO paper's bytes per parameter for mixed-precision Adam (2 + 2 of fp16 parameters and
gradients, K = 12 of optimizer state), partitioned over N ranks:
    data parallel 16,  stage 1 (P_os) 4 + 12/N,  stage 2 (P_g) 2 + 14/N,  stage 3 (P_p) 16/N.
`MemoryReport` holds what a rank measured (the .nbytes of its real buffers: parameters,
gradients, optimizer states, and the transient buffers in flight: gathered layers, gradient
buckets, exchange buffers); `model_state_bytes` is the exact per-rank count those formulas
predict for an uneven chunk() partition, so tests can compare the two to the byte.
See docs/ARCHITECTURE.md (ZeRO).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["MemoryReport", "InFlight", "nbytes", "model_state_bytes", "paper_bytes_per_param"]


def nbytes(*arrays) -> int:
    """Bytes held by these arrays (None skipped; an array listed twice counted once)."""
    seen, total = set(), 0
    for a in arrays:
        if a is None or id(a) in seen:
            continue
        seen.add(id(a))
        total += int(a.nbytes)
    return total


class InFlight:
    """Bytes of transient buffers (gathered parameters, gradient buckets, exchange buffers).

    add() when a buffer is allocated, drop() when it is released; `peak` is the high-water
    mark since the last reset_peak().
    """

    def __init__(self):
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def add(self, *arrays):
        """Count arrays as held in flight (each once) and raise the peak."""
        for a in arrays:
            if a is None or id(a) in self._live:
                continue
            self._live[id(a)] = int(a.nbytes)
            self.current += int(a.nbytes)
        self.peak = max(self.peak, self.current)
        return arrays[0] if len(arrays) == 1 else arrays

    def drop(self, *arrays) -> None:
        """No longer count these arrays."""
        for a in arrays:
            if a is not None:
                self.current -= self._live.pop(id(a), 0)

    def reset_peak(self) -> None:
        """Start a new peak from what is held now."""
        self.peak = self.current


@dataclass(frozen=True)
class MemoryReport:
    """What one rank holds, in bytes, measured from its buffers."""
    stage: int              # 0 = plain data parallel
    rank: int
    size: int
    numel: int              # parameters of the whole model
    shard: int              # parameters in this rank's shard
    params: int
    grads: int
    optim: int              # optimizer states incl. the fp32 master copy of half params
    workspace: int          # persistent work buffers that are not model state (fp32 grad scratch)
    in_flight: int          # transient buffers live now
    peak_in_flight: int     # their high-water mark (since the last step began)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optim

    @property
    def bytes_per_param(self) -> float:
        return self.model_states / max(1, self.numel)

    def as_metrics(self, prefix: str = "mem_") -> dict:
        """The byte counts as metrics entries named prefix + field."""
        d = asdict(self)
        out = {prefix + k: d[k] for k in ("params", "grads", "optim", "workspace",
                                          "in_flight", "peak_in_flight")}
        out[prefix + "model_states"] = self.model_states
        return out

    def format(self) -> str:
        """One line for the log: MiB per kind and bytes per parameter."""
        mib = 1 << 20
        name = "dp" if self.stage == 0 else f"zero-{self.stage}"
        return (f"rank {self.rank}/{self.size} {name}: params {self.params / mib:.2f} MiB, "
                f"grads {self.grads / mib:.2f} MiB, optimizer {self.optim / mib:.2f} MiB, "
                f"model states {self.model_states / mib:.2f} MiB ({self.bytes_per_param:.2f} "
                f"B/param), workspace {self.workspace / mib:.2f} MiB, in flight "
                f"{self.in_flight / mib:.2f} MiB (peak {self.peak_in_flight / mib:.2f} MiB)")


def model_state_bytes(stage: int, numel: int, shard: int, *, param_bytes: int,
                      grad_bytes: int, optim_bytes: int) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes a rank holds at `stage` (0 = data parallel).

    shard: elements in this rank's shard; *_bytes: bytes per element of each kind
    (optim_bytes counts every fp32 state and the fp32 master copy when params are half).
    """
    full = {0: (True, True, True), 1: (True, True, False),
            2: (True, False, False), 3: (False, False, False)}
    if stage not in full:
        raise ValueError(f"stage must be 0 (data parallel), 1, 2 or 3, got {stage!r}")
    whole = full[stage]
    return tuple((numel if w else shard) * b
                 for w, b in zip(whole, (param_bytes, grad_bytes, optim_bytes)))


def paper_bytes_per_param(stage: int, size: int, *, param_bytes: int = 2, grad_bytes: int = 2,
                          optim_bytes: int = 12) -> float:
    """The paper's per-parameter model-state bytes with N = size ranks dividing evenly."""
    p, g, k = model_state_bytes(stage, size, 1, param_bytes=param_bytes,
                                grad_bytes=grad_bytes, optim_bytes=optim_bytes)
    return (p + g + k) / size
