"""Per-stage timing of a pipeline step as it actually ran: busy and idle time per rank, the
measured bubble fraction, peak activation memory, and a PNG timeline.

Every rank times its own forwards and backwards from a common start (the executor's first
collective); the step's makespan is the slowest rank's end, and a rank is idle for whatever
of the makespan it did not compute. `summarize` gives the measured bubble, `replay` what
the same step would have cost with instant transfers, so the distance from the ideal splits
into the compute's own unevenness and the executor's cost.
See docs/BENCHMARKS.md (reading bench pipeline) and docs/ARCHITECTURE.md (pipeline).
"""
from __future__ import annotations

import numpy as np

from mpidist.pipeline.executor import StepStats

__all__ = ["summarize", "gather_events", "replay", "plot_timeline"]


def _bubbles(makespan: float, busy: list[float]) -> dict:
    """The mean over ranks of idle / makespan, and the busiest rank's own."""
    if makespan <= 0:
        return {"bubble": 0.0, "bubble_busiest": 0.0}
    idle = [makespan - b for b in busy]
    return {"bubble": float(np.mean(idle) / makespan),
            "bubble_busiest": float(min(idle) / makespan)}


def summarize(stats: StepStats, comm) -> dict:
    """Collective over the pipeline communicator: the step's timing and memory, same on
    every rank. Lists are per pipeline rank.

    bubble = mean over ranks of idle / makespan, which an ideal pipeline of uniform stages
    makes (p - 1) / (v m + p - 1). Stages that are not quite uniform add the faster stages'
    wait for the slowest to that mean; the busiest rank's own idle / makespan
    ("bubble_busiest") leaves that imbalance out: it is the fill and drain the schedule itself
    costs on the critical stage.
    """
    rows = comm.comm.allgather((stats.wall, stats.busy, stats.peak_in_flight,
                                stats.peak_stash_bytes, stats.microbatch_stash_bytes))
    wall, busy, in_flight, peak_bytes, mb_bytes = (list(c) for c in zip(*rows))
    makespan = max(wall)
    idle = [makespan - b for b in busy]
    return {
        "makespan": makespan,
        "busy": busy,
        "idle": idle,
        **_bubbles(makespan, busy),
        "peak_in_flight": in_flight,
        "peak_stash_bytes": peak_bytes,
        "microbatch_stash_bytes": mb_bytes,
        # peak activation memory in micro-batches' worth (chunk stashes over one's size)
        "peak_microbatches": [p / b if b else 0.0 for p, b in zip(peak_bytes, mb_bytes)],
    }


def gather_events(stats: StepStats, comm, root: int = 0) -> list[list] | None:
    """Collective: every rank's (kind, microbatch, stage, t0, t1) events on root, else None."""
    return comm.comm.gather(stats.events, root=root)


def replay(events_by_rank: list[list]) -> dict:
    """The step again with the measured compute durations, each compute starting as soon
    as its rank's previous compute and its input's producer (forward of the stage before,
    backward of the stage after) have finished: {"makespan", "bubble", "bubble_busiest"}.

    `replay` splits the distance from that ideal in two: it re-runs the ranks' programs with
    the compute times they measured but free, instant transfers. The ideal-to-replay part
    comes from the compute itself (stages that are not quite uniform, jitter of one op on
    one rank holding up its neighbour); the replay-to-measured part is the executor's own
    cost between computes (transfers, Python dispatch).
    """
    durations = [[(kind, mb, stage, t1 - t0) for kind, mb, stage, t0, t1 in ev]
                 for ev in events_by_rank]
    last = max((e[2] for ev in durations for e in ev), default=0)
    done: dict[tuple, float] = {}
    clock = [0.0] * len(durations)
    nxt = [0] * len(durations)
    while any(i < len(ev) for i, ev in zip(nxt, durations)):
        moved = False
        for r, ev in enumerate(durations):
            while nxt[r] < len(ev):
                kind, mb, stage, d = ev[nxt[r]]
                producer = ((kind, mb, stage - 1) if kind == "F" and stage > 0 else
                            (kind, mb, stage + 1) if kind == "B" and stage < last else None)
                if producer is not None and producer not in done:
                    break
                clock[r] = max(clock[r], done.get(producer, 0.0)) + d
                done[(kind, mb, stage)] = clock[r]
                nxt[r] += 1
                moved = True
        if not moved:
            raise ValueError("the events cannot be replayed: a compute waits for one that "
                             "never ran")
    makespan = max(clock)
    busy = [sum(e[3] for e in ev) for ev in durations]
    return {"makespan": makespan, **_bubbles(makespan, busy)}


def plot_timeline(events_by_rank: list[list], path: str, title: str = "", virtual: int = 1,
                  pp: int | None = None) -> str:
    """Draw the step as it ran: one row per rank, forwards light and backwards dark, each
    box labelled with its micro-batch (and chunk). Writes a PNG; returns the path."""
    import matplotlib                  # slow to import, and only rank 0 draws
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp = len(events_by_rank) if pp is None else pp
    colors = {"F": ["#8fb8de", "#b5d99c", "#f2c57c", "#d4a5e0"],
              "B": ["#2f6fa8", "#4d8a2e", "#c47f14", "#8a46a3"]}
    end = max((e[4] for ev in events_by_rank for e in ev), default=1.0)
    fig, ax = plt.subplots(figsize=(min(24, 6 + 0.25 * sum(map(len, events_by_rank)) / max(1, pp)),
                                    1 + 0.6 * pp))
    for r, events in enumerate(events_by_rank):
        for kind, mb, stage, t0, t1 in events:
            chunk = stage // pp
            ax.broken_barh([(t0 * 1e3, (t1 - t0) * 1e3)], (r - 0.4, 0.8),
                           facecolors=colors[kind][chunk % 4], edgecolor="black", linewidth=0.3)
            if (t1 - t0) > 0.012 * end:
                label = f"{kind}{mb}" + (f".{chunk}" if virtual > 1 else "")
                ax.text((t0 + t1) / 2 * 1e3, r, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(events_by_rank)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(events_by_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("time since step start (ms)")
    ax.set_xlim(0, end * 1e3 * 1.01)
    ax.set_title(title or "pipeline timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
