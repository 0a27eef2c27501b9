"""Inside the MPI job: every variant's training run on COMM_WORLD's ranks, one after the
other, each from the same initial GPT and the same windows; rank 0 prints the curves."""
from __future__ import annotations

import json
import time

from experiments import common
from mpidist.optim.lr_schedules import LRSchedule


def variants(cfg: dict) -> list[tuple[str, int, int]]:
    """(method, H, fragments): data parallel, DiLoCo at each H, streaming DiLoCo."""
    return ([("dp", 1, 1)] + [("diloco", h, 1) for h in cfg["H"]]
            + [("streaming", cfg["stream_H"], cfg["fragments"])])


def _val_batch(text, cfg: dict):
    """The held-out windows: evenly spaced over the last 10% of the text."""
    import torch
    block, n = cfg["block"], cfg["eval_windows"]
    starts = torch.linspace(0, len(text) - block - 2, n).long()
    x = torch.stack([text[s:s + block] for s in starts]).long()
    y = torch.stack([text[s + 1:s + block + 1] for s in starts]).long()
    return x, y


def _run(world, method: str, H: int, fragments: int, cfg: dict, train, val) -> dict:
    """One training run: its curve (step, seconds, bytes per rank, validation loss of this
    rank's model: mid-round, its group's inner model)."""
    import torch
    import torch.nn.functional as F
    import mpidist.torch as mt
    from mpidist.simcluster import nic_bytes
    from mpidist.torch.models import GPT, windows
    torch.manual_seed(0)
    model = GPT(cfg["block"], cfg["dim"], cfg["layers"], cfg["heads"])
    params = sum(p.numel() for p in model.parameters())
    if method == "dp":
        opt = inner = mt.DistributedOptimizer(model, "adamw", lr=cfg["lr"], weight_decay=0.01,
                                              comm=world)
    else:
        groups = mt.make_groups(world)                     # a group per node
        inner = mt.DistributedOptimizer(model, "adamw", lr=cfg["lr"], weight_decay=0.01,
                                        comm=groups.group)
        opt = mt.DiLoCo(model, inner, sync_every=H, outer_lr=cfg["outer_lr"],
                        outer_momentum=cfg["outer_momentum"], groups=groups,
                        fragments=fragments)
    ring = 2 * (world.size - 1) / world.size * 4 * params       # DP: bytes per step per rank
    per_rank = cfg["batch"] // world.size       # the same tokens per step at every shape
    lr = LRSchedule("cosine", cfg["lr"], cfg["steps"], warmup_steps=cfg["warmup"],
                    end_lr=cfg["end_lr"])

    def sent() -> float:
        return ring * step if method == "dp" else float(opt.outer.bytes_sent)

    def val_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss = F.cross_entropy(model(val[0]).flatten(0, 1), val[1].flatten()).item()
        model.train()
        return loss

    step, seconds, curve = 0, 0.0, []
    curve.append((0, 0.0, 0.0, val_loss()))
    world.comm.Barrier()
    nic0 = nic_bytes() if world.local_rank == 0 else None
    for step in range(1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        x, y = windows(train, step, world.rank, per_rank, cfg["block"])
        for group in inner.param_groups:                    # DP's, or DiLoCo's inner one
            group["lr"] = lr(step - 1)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        if step == cfg["steps"] and method != "dp":
            opt.finish()         # the budget's end: rounds still open take their outer step
        seconds += time.perf_counter() - t0
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            curve.append((step, seconds, sent(), val_loss()))   # the clock stops for it
    world.comm.Barrier()
    nic1 = nic_bytes() if world.local_rank == 0 else None
    nics = [None if a is None or b is None else [b[0] - a[0], b[1] - a[1]]
            for a, b in world.comm.allgather((nic0, nic1))]
    seconds_max = world.comm.allreduce(seconds, op=_max())
    bytes_max = world.comm.allreduce(sent(), op=_max())
    inner.close()
    return {"method": method, "H": H, "fragments": fragments, "params": params,
            "curve": curve, "seconds": seconds_max, "bytes_per_rank": bytes_max,
            "nic": [n for n in nics if n is not None]}


def _max():
    from mpi4py import MPI
    return MPI.MAX


def main(spec: str) -> None:
    """Run every variant; spec is the JSON of the settings."""
    import torch
    from mpidist.comm import Communicator
    cfg = json.loads(spec)
    torch.set_num_threads(1)
    world = Communicator()
    if cfg["batch"] % world.size:
        raise ValueError(f"batch ({cfg['batch']} windows a step) must split evenly among the "
                         f"{world.size} ranks")
    with open(f"{common.REPO}/data/sample.txt", "rb") as fh:
        text = torch.frombuffer(bytearray(fh.read()), dtype=torch.uint8)
    cut = len(text) * 9 // 10
    train, val = text[:cut], _val_batch(text[cut:], cfg)
    runs = [_run(world, m, h, f, cfg, train, val) for m, h, f in variants(cfg)]
    if world.rank == 0:
        common.emit({"nodes": world.num_nodes, "per_node": world.local_size, "runs": runs})
    world.free()
