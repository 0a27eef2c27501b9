"""Bounds of a data-parallel step on a link, for the benchmarks: the bytes a ring must carry
(the link bound), when the last of them can arrive given when each bucket's gradients were
final (the overlap bound), and the share of a link's rate that TCP's payload gets, so that
a row can be read against what any transport over TCP could reach.
"""
from __future__ import annotations

import numpy as np

__all__ = ["link_bound", "overlap_bound", "tcp_payload_share", "at_payload_rate"]

MTU = 1500          # Linux's default, which the simulated cluster's links keep


def link_bound(params: int, ranks: int, nodes: int, batch: int, bits_per_s: float | None):
    """(bytes each rank sends per step over the slowest link, samples/s the link allows):
    a ring allreduce of the fp32 gradients sends 2(n-1)/n of them over each node's link (n
    nodes; within a node the sum is local), or None without a bandwidth or with one node."""
    if not bits_per_s or nodes < 2:
        return None
    sent = 2 * (nodes - 1) / nodes * 4 * params
    return sent, batch * ranks / (sent * 8 / bits_per_s)


def overlap_bound(ready: dict, nodes: int, bits_per_s: float | None):
    """(step seconds, bucket) that a perfectly overlapped exchange could reach, from one
    variant's `ready` (bucket bytes; per step, the seconds into it each bucket's gradients
    were final, on the last rank): no step ends before, for every bucket, the time it was
    final plus what the link must carry from it on (2(n-1)/n of those buckets' bytes, as
    link_bound). The median over the steps, and the bucket that sets it most often. None
    without a link to bound it (one node, no bandwidth) or a step."""
    if not bits_per_s or nodes < 2 or not ready["at"]:
        return None
    tail = np.cumsum(np.asarray(ready["bytes"], dtype=np.float64)[::-1])[::-1]
    ends = np.asarray(ready["at"], dtype=np.float64) + 2 * (nodes - 1) / nodes * tail * 8 / bits_per_s
    binding = np.bincount(np.argmax(ends, axis=1), minlength=len(tail))
    return float(np.median(ends.max(axis=1))), int(np.argmax(binding))


def tcp_payload_share(mtu: int = MTU) -> float:
    """The share of a shaped link's rate left to TCP's payload: tc counts each full frame's
    Ethernet (14 bytes), IPv4 (20) and TCP headers (32, with the timestamps Linux sends)
    beside its mtu - 52 bytes of payload. An estimate (the acknowledgements in the other
    direction are not counted) of what no transport over TCP on such a link can exceed."""
    return (mtu - 52) / (mtu + 14)


def at_payload_rate(r, which, rate: float, variants) -> str:
    """A report line: the link and overlap bounds of `bench torch`'s row r again at the rate
    TCP's payload gets, and each of its variants' share of the tighter one (which: the
    variant whose buckets set the overlap bound)."""
    share = tcp_payload_share()
    payload = rate * share
    samples = r["batch_per_rank"] * r["ranks"]
    _, link = link_bound(r["params"], r["ranks"], r.get("nodes", 1), r["batch_per_rank"], payload)
    over = overlap_bound(r["ready"][which], r.get("nodes", 1), payload) if which else None
    best = min(link, samples / over[0]) if over else link
    shares = ", ".join(f"{v} {100 * r[v]['samples_per_s'] / best:.0f}%"
                       for v in variants if v in r and v != "torch")
    return (f"{'':>5} at the TCP payload rate ({100 * share:.1f}% of the link): link bound "
            f"{link:.0f} samples/s" + (f", overlap bound {over[0] * 1e3:.1f} ms per step"
                                       if over else "") + f": {shares}")
