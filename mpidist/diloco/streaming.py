"""Streaming DiLoCo's schedule (Douillard et al. 2025, arXiv 2501.18512), as pure data.

The model's flat buffer is cut into F fragments of whole tensors, of about equal size.
Each fragment has its own outer step every H inner steps, fragment f offset by f * H // F
steps, so the groups exchange 1/F of the model F times per H steps instead of all of it
at once: the same bytes, spread evenly, a smaller peak on the slow link. Every fragment
also steps at the job's last step, so the job ends on theta_outer. F = 1 is DiLoCo.

    >>> print(format_schedule(4, 2, 8))
    step       1 2 3 4 5 6 7 8
    fragment 0 . . . X . . . X
    fragment 1 . X . . . X . X
"""
from __future__ import annotations

__all__ = ["fragment_spans", "first_syncs", "round_starts", "fragments_due", "format_schedule"]


def fragment_spans(layout, fragments: int) -> list[tuple[int, int]]:
    """[(lo, hi)] of `fragments` runs of whole tensors covering the layout, each cut at the
    tensor boundary nearest an equal split (none empty; at most one per tensor)."""
    n, segs = layout.numel, layout.segments
    if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= len(segs):
        raise ValueError(f"fragments must be an int in [1, {len(segs)}] (the model's tensors), "
                         f"got {fragments!r}")
    bounds = [s.offset for s in segs[1:]]          # where a fragment may start
    cuts, prev = [], -1
    for f in range(1, fragments):
        # after the previous cut, leaving a boundary for each later fragment
        last = len(bounds) - (fragments - f)
        i = min(range(prev + 1, last + 1), key=lambda i: abs(bounds[i] - n * f / fragments))
        cuts.append(bounds[i])
        prev = i
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:]))


def first_syncs(sync_every: int, fragments: int) -> list[int]:
    """The step of each fragment's first outer step: H for fragment 0, f * H // F for the
    others (fragments must not outnumber H, so every offset is a distinct step)."""
    if fragments > sync_every:
        raise ValueError(f"{fragments} fragments need sync_every >= {fragments} (one offset step each), "
                         f"got {sync_every}")
    return [f * sync_every // fragments or sync_every for f in range(fragments)]


def round_starts(step: int, sync_every: int, fragments: int) -> list[int]:
    """The step each fragment's current round started after `step` inner steps (its last
    outer step, or first_syncs - H before the first), by the schedule alone."""
    out = []
    for first in first_syncs(sync_every, fragments):
        out.append(step - (step - first) % sync_every if step >= first else first - sync_every)
    return out


def fragments_due(step: int, round_starts: list[int], sync_every: int, total: int = 0) -> list[int]:
    """The fragments whose outer step comes after inner step `step` (counted from 1), given
    the step each one's round started (first_syncs - H at the start); all at `total`."""
    if total and step >= total:
        return list(range(len(round_starts)))
    return [f for f, start in enumerate(round_starts) if step - start >= sync_every]


def format_schedule(sync_every: int, fragments: int, steps: int) -> str:
    """The schedule as a grid: X where a fragment has its outer step."""
    starts = round_starts(0, sync_every, fragments)
    rows = [[] for _ in range(fragments)]
    for t in range(1, steps + 1):
        due = fragments_due(t, starts, sync_every, steps)
        for f in range(fragments):
            rows[f].append("X" if f in due else ".")
            if f in due:
                starts[f] = t
    width = len(str(steps))
    head = "step       " + " ".join(str(t).rjust(width) for t in range(1, steps + 1))
    return "\n".join([head] + [f"fragment {f} " + " ".join(c.rjust(width) for c in row)
                               for f, row in enumerate(rows)])
