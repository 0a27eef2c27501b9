"""`strategy = "diloco"` and `"local_sgd"`: data parallel inside groups of ranks, an outer
step across groups every H inner steps (mpidist.diloco; Douillard et al. 2023, DiLoCo).

[parallel] group_size (0: a group per node), sync_every (H), outer_lr and outer_momentum
(diloco: Nesterov SGD, 0.7 and 0.9 by default; local_sgd: averaging, lr 1, no momentum),
outer_compression (+ outer_compression_options) for the exchange between groups,
outer_fragments (streaming: each fragment of the model on its own offset schedule); the inner
step is the job's optimizer, data parallel over the group (algorithm, bucket_mb,
accumulation as for dp). Every rank reads its own rows of each global batch, so a group of
k ranks trains on k/p of it; the loss and metrics are the global ones (one 24-byte
allreduce per step), the heavy traffic stays in the group. The last step syncs too, so
the job ends on theta_outer; between syncs evaluation sees each group's own model on its
share of the test rows.

Checkpoints: params/ is theta_outer and optim/outer_momentum_buffer/ its momentum (the
model state, resharded at any world size); each group's inner parameters and optimizer
state are rows of diloco/params/ and diloco/optim/<state>/ ((G, *shape) tensors), the
round's sample counts diloco/round (G, 2), the outer exchange's residuals compress/ (one row
per group). Resumed with the same number of groups, at any world size, a checkpoint
written mid-round continues the same trajectory (up to summation order where the groups
read the same rows); with another number, every group runs the rest of the round from
theta_outer, the syncs stay at the same steps, and group g takes the inner optimizer
state of old group g * G_old // G.

Under [job] fault_tolerance = "shrink" (mpidist.ft.recovery) every rank holds theta_outer,
its momentum and its group's whole inner state, so a lost rank costs little: the survivors
keep their groups ([parallel] groups), take the newest outer sync any of them completed
and, per group, the inner state of its member with the newest inner step (replica_state_dict;
mpidist.diloco.replicas); a group with no survivor is dropped: its partial round never reaches
the next outer step, whose weights are the surviving groups' shares of the samples.
"""
from __future__ import annotations

import numpy as np

from mpidist.compress import make_compressor
from mpidist.diloco import OuterOptimizer, make_groups
from mpidist.diloco.streaming import fragments_due, round_starts
from mpidist.engine.dp import DataParallel
from mpidist.kernels.backend import to_numpy
from mpidist.partition import chunk
from mpidist.state import StateDict, TensorPiece, read_flat, read_params, replicated_pieces
from mpidist.strategy.base import Strategy
from mpidist.strategy.compression_state import compression_pieces, compression_scalars, restore_compression

__all__ = ["DiLoCo", "LocalSGD"]


def _row_pieces(prefix: str, layout, flat, row: int, rows: int, rank: int, size: int) -> dict:
    """Row `row` of the (rows, *shape) tensors "<prefix>/<name>": the group's flat buffer,
    written by its `size` ranks, rank by rank a chunk of it."""
    lo, count = layout.shard(rank, size)
    out = {}
    for index, start, stop in layout.clip(lo, lo + count):
        seg = layout.segments[index]
        out[f"{prefix}/{seg.name}"] = TensorPiece((rows, *seg.shape), row * seg.size + start - seg.offset,
                                                  to_numpy(flat[start:stop]))
    return out


def _read_row(source, prefix: str, layout, out, row: int) -> None:
    """Fill the flat buffer out from row `row` of the (rows, *shape) tensors "<prefix>/<name>"."""
    for seg in layout.segments:
        key = f"{prefix}/{seg.name}"
        if tuple(source.shape(key)[1:]) != seg.shape:
            raise ValueError(f"checkpoint tensor {key} has rows of shape {tuple(source.shape(key)[1:])}, "
                             f"the model's {seg.name} is {seg.shape}")
        out[seg.offset:seg.stop] = np.asarray(source.read(key, row * seg.size, seg.size), dtype=out.dtype)


class DiLoCo(Strategy):
    """DiLoCo over groups of ranks, each group an inner data-parallel job (engine.dp)."""
    name = "diloco"
    keys = ("group_size", "groups", "sync_every", "outer_lr", "outer_momentum", "outer_compression",
            "outer_compression_options", "outer_fragments")

    @classmethod
    def config_errors(cls, parallel: dict, world_size: int | None = None) -> list[str]:
        errors = super().config_errors(parallel, world_size)
        if parallel["compression"] != "none":
            errors.append(f"[parallel] compression = {parallel['compression']!r}: strategy = "
                          f"{cls.name!r} keeps gradients within a group; compress the exchange "
                          f"between groups with outer_compression instead")
        name, options = parallel["outer_compression"], parallel["outer_compression_options"]
        if name != "none":
            try:
                make_compressor(name, **(options if isinstance(options, dict) else {}))
            except (TypeError, ValueError) as exc:
                errors.append(f"[parallel] outer_compression = {name!r}: {exc}")
        elif options:
            errors.append("[parallel] outer_compression_options needs outer_compression = '<name>'")
        if parallel["outer_fragments"] > parallel["sync_every"]:
            errors.append(f"[parallel] outer_fragments = {parallel['outer_fragments']} needs sync_every >= "
                          f"{parallel['outer_fragments']} (each fragment its own step in a round)")
        groups = parallel.get("groups")
        if groups and world_size is not None and len(groups) != world_size:
            errors.append(f"[parallel] groups has {len(groups)} entries: give the group of each of the "
                          f"{world_size} ranks")
        return errors

    def outer_hyper(self, parallel: dict) -> tuple[float, float]:
        """(outer lr, outer momentum) of this strategy."""
        return parallel["outer_lr"], parallel["outer_momentum"]

    def __init__(self, config: dict, comm, meta: dict):
        super().__init__(config, comm, meta)
        p = config["parallel"]
        self.groups = make_groups(comm, p["group_size"], colors=p.get("groups"))
        self.inner = DataParallel(config, self.groups.group, meta)
        self.model, self.layout = self.inner.model, self.inner.layout
        self.sync_every = int(p["sync_every"])
        self.total_steps = int(config["job"].get("total_steps") or 0)
        lr, momentum = self.outer_hyper(p)
        self.outer = OuterOptimizer(self.inner.params.data, self.layout, self.groups, lr=lr,
                                    momentum=momentum, compression=p["outer_compression"],
                                    compression_options=p["outer_compression_options"],
                                    algorithm=p["algorithm"], fragments=p["outer_fragments"])
        self.fragments = int(p["outer_fragments"])
        # per fragment: the step its round started, its samples (my group's, all groups')
        self.round_starts = round_starts(0, self.sync_every, self.fragments)
        self.round = np.zeros((self.fragments, 2))

    def group_rows(self, global_count: int) -> int:
        """Rows of a global batch of global_count that my group reads (no communication)."""
        return sum(chunk(global_count, r, self.comm.size)[1] for r in self.groups.members)

    def train_step(self, x, y, global_count: int | None = None) -> dict:
        if global_count is None:
            global_count = self.comm.comm.allreduce(0 if x is None else len(x))
        group_count = self.group_rows(global_count)
        m = self.inner.train_step(x, y, global_count=group_count)
        # the round's samples move with the inner state (a recovery keeps both or neither);
        # the step counts once the job-wide exchanges below are done
        self.round += (group_count, global_count)
        # the global loss and accuracy: each group's sums once, from its leader
        stats = np.zeros(3)
        if self.groups.is_leader:
            stats[:] = (m["loss"] * m["count"], m["correct"], m["count"])
        self.comm.comm.Allreduce(np.copy(stats), stats)
        step = self.step + 1
        out = {**m, "loss": stats[0] / max(stats[2], 1), "correct": int(stats[1]), "count": int(stats[2]),
               "synced": False}
        due = fragments_due(step, self.round_starts, self.sync_every, self.total_steps)
        if due:
            def round_done(f):     # fragment by fragment: in step with its theta_outer if a later one fails
                self.round_starts[f], self.round[f] = step, 0

            info = self.outer.sync(self.inner.params.data, self.round[:, 0] / np.maximum(self.round[:, 1], 1), due,
                                   done=round_done)
            out.update(synced=True, fragments=due, outer_skipped=info["skipped"], outer_bytes=info["bytes"],
                       t_comm=m["t_comm"] + info["t_comm"], t_optim=m["t_optim"] + info["t_optim"])
        self.step = step
        return out

    def evaluate(self, x, y) -> dict:
        loss_sum = correct = 0.0
        count = 0 if x is None else len(x) * self.inner.tokens
        if count:
            logits = self.inner.predict(x)
            loss_sum, correct = self.inner.loss.forward(logits, self.inner.xp.asarray(y))
        totals = self.comm.comm.allreduce(np.array([loss_sum, correct, count], dtype=np.float64))
        return {"loss": float(totals[0]), "correct": int(totals[1]), "count": int(totals[2])}

    def state_dict(self) -> StateDict:
        g = self.groups
        sd = self._state(self.comm.rank, self.comm.size, g.index, g.count, g.group.rank, g.group.size, g.is_leader)
        ca = self.outer.compressed
        if ca is not None:           # leaders only: the outer exchange's residuals, a row per group
            sd.tensors.update(compression_pieces(ca, self.layout, g.index, g.count))
            sd.scalars["compression"] = compression_scalars(ca)
        return sd

    def replica_state_dict(self) -> StateDict:
        """All this rank holds, whole: theta_outer and its momentum, and its group's inner
        state as the one row of a one-group state, marked as the loading group's own
        ("diloco_own"; "diloco_group": [group, groups]; "inner_step"; "inner_round_starts":
        the outer syncs the inner state follows). What a recovery agrees on and loads."""
        sd = self._state(0, 1, 0, 1, 0, 1, True)
        sd.scalars.update(diloco_own=True, diloco_group=[self.groups.index, self.groups.count],
                          inner_step=self.inner.step, inner_round_starts=list(self.round_starts))
        return sd

    def _state(self, r: int, s: int, row: int, rows: int, gr: int, gs: int, leader: bool) -> StateDict:
        """The state as rank r of s writes it, its group's inner state as row `row` of `rows`
        (written by group rank gr of gs; the round's counts by the leader)."""
        tensors = replicated_pieces("params", self.layout, self.outer.theta, r, s)
        for name, buf in sorted(self.outer.state_buffers().items()):
            tensors.update(replicated_pieces(f"optim/outer_{name}", self.layout, buf, r, s))
        tensors.update(_row_pieces("diloco/params", self.layout, self.inner.params.data, row, rows, gr, gs))
        inner = self.inner.optimizer
        for name, buf in sorted(inner.state_buffers().items()):
            tensors.update(_row_pieces(f"diloco/optim/{name}", self.layout, buf, row, rows, gr, gs))
        scalars = {"optim_step": inner.step_count, "optim": inner.name, "optim_extra": inner.extra_state(),
                   "outer_step": self.outer.step_counts[0], "outer_steps": self.outer.step_counts,
                   "outer_syncs": self.outer.steps, "diloco_groups": rows,
                   "round_start": self.round_starts[0], "round_starts": list(self.round_starts)}
        if leader:
            width = 2 * self.fragments
            tensors["diloco/round"] = TensorPiece((rows, width), width * row, self.round.reshape(-1).copy())
        return StateDict(self.step, tensors, scalars)

    def load_state_dict(self, source) -> None:
        g, sc = self.groups, source.scalars
        keys = set(source.keys())
        read_params(source, self.layout, self.outer.theta)
        outer = self.outer.state_buffers()
        for name, buf in outer.items():
            read_flat(source, f"optim/outer_{name}", self.layout, buf)
        self.outer.load_state_buffers(outer)
        counts = sc.get("outer_steps", [sc.get("outer_step", 0)])
        self.outer.step_counts = counts if len(counts) == self.fragments else max(counts)
        self.outer.steps = int(sc.get("outer_syncs", 0))
        self.step = int(source.step)
        old = int(sc.get("diloco_groups", 0))
        own = bool(sc.get("diloco_own"))     # replica_state_dict's: my group's own inner state
        rows = 1 if own else g.count
        same = (own or old == g.count) and all(f"diloco/params/{seg.name}" in keys for seg in self.layout.segments)
        params = self.inner.params.data
        starts = sc.get("round_starts", [sc["round_start"]] if "round_start" in sc else [])
        self.round_starts = list(starts) if len(starts) == self.fragments else \
            round_starts(self.step, self.sync_every, self.fragments)          # the step within H
        width = 2 * self.fragments
        self.round[:] = 0
        row = 0 if own else g.index
        if same:                     # the round goes on where it stood
            _read_row(source, "diloco/params", self.layout, params, row)
            if "diloco/round" in keys and tuple(source.shape("diloco/round")) == (rows, width):
                self.round[:] = np.reshape(source.read("diloco/round", width * row, width), (-1, 2))
            # a fragment synced since the inner state was taken: its new round from theta_outer
            for f, started in enumerate(sc.get("inner_round_starts", self.round_starts)):
                if started < self.round_starts[f]:
                    lo, hi = self.outer.spans[f]
                    params[lo:hi] = self.outer.theta[lo:hi]
                    self.round[f] = 0
        else:                        # the rest of the round from theta_outer
            params[...] = self.outer.theta
            row = g.index * old // g.count if old else 0
        if own:                      # the round's total: what the groups now here trained on
            counts = self.round[:, 0].copy() if g.is_leader else np.zeros(self.fragments)
            self.comm.comm.Allreduce(np.copy(counts), counts)
            self.round[:, 1] = counts
        inner = self.inner.optimizer
        for name, buf in inner.state_buffers().items():
            if f"diloco/optim/{name}/{self.layout.segments[0].name}" in keys:
                _read_row(source, f"diloco/optim/{name}", self.layout, buf, row)
        inner.step_count = int(sc.get("optim_step", source.step))
        if "optim_extra" in sc:
            inner.load_extra_state(sc["optim_extra"])
        self.inner.step = int(sc.get("inner_step", self.step))
        self.inner.dopt.zero_grad()
        ca = self.outer.compressed
        if ca is not None:
            restore_compression(ca, source, self.layout, [(lo, hi - lo) for lo, hi in self.outer.spans],
                                g.index, g.count)

    def memory_report(self) -> dict:
        rep = self.inner.memory_report()
        outer = int(self.outer.theta.nbytes + self.outer.delta.nbytes) + \
            sum(int(b.nbytes) for b in self.outer.state_buffers().values())
        rep["optim"] += outer
        rep["total"] += outer
        return rep

    def close(self) -> None:
        self.inner.close()


class LocalSGD(DiLoCo):
    """Local SGD: DiLoCo whose outer step is plain averaging (outer lr 1, no momentum)."""
    name = "local_sgd"
    keys = ("group_size", "groups", "sync_every", "outer_compression", "outer_compression_options",
            "outer_fragments")

    def outer_hyper(self, parallel: dict) -> tuple[float, float]:
        return 1.0, 0.0
