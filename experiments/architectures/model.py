"""The analytic models the measurements are set against.

The paper (Alqahtani and Demirbas, 2019) models synchronous SGD by the bytes through the
busiest link. Its text here holds the abstract only, so the model is written out in its
usual form, for a model of n bytes, p workers, S servers and full-duplex links of
B bytes/s (each node one NIC). One step moves, through the busiest NIC and direction:
    PS:   p n / S per phase, two phases (push, then pull)   T = 2 p n / (S B)
    P2P:  (p-1) n / p per phase (reduce-scatter by all-to-all, then all-gather)
                                                            T = 2 (p-1) n / (p B)
    ring: 2 (p-1) n / p in 2 (p-1) steps                    T = 2 (p-1) n / (p B)
    hierarchical, N nodes x L ranks: 2 (N-1) n / N per NIC  T = 2 (N-1) n / (N B)
                  (flat ring over the same ranks:           2 (NL-1) n / (NL) per NIC)
Beside it, mpidist's own alpha-beta(-gamma) fit (the cost model's probe on the cluster)
predicts each as a alpha + b n beta + g n gamma with the same counts a, b, g.
"""
from __future__ import annotations


def link_bytes(variant: str, p: int, n: float, servers: int = 1) -> float:
    """Bytes through the busiest NIC in its busier direction, per step (the paper's model)."""
    if variant == "ps":             # a server receives p n / S, then sends p n / S
        return max(p * n / servers, n)          # a worker's own link bounds it
    if variant in ("p2p", "ring", "native"):
        return 2 * (p - 1) * n / p
    raise ValueError(f"unknown variant {variant!r}; valid: ps, p2p, ring, native")


def link_seconds(variant: str, p: int, n: float, rate: float, servers: int = 1) -> float:
    """The paper's communication time per step at link rate `rate` bytes/s: the PS's push
    and pull phases follow each other, so its link time counts twice."""
    return link_bytes(variant, p, n, servers) * (2 if variant == "ps" else 1) / rate


def node_bytes(variant: str, nodes: int, per_node: int, n: float) -> float | None:
    """Phase B, block placement: bytes out of each node's NIC per allreduce (the paper's
    model; None for MPI_Allreduce, whose algorithm is the library's choice)."""
    p = nodes * per_node
    if variant == "ring":           # one ring edge leaves each node
        return 2 * (p - 1) * n / p
    if variant == "hierarchical":   # L inter-node rings of n / L each
        return 2 * (nodes - 1) * n / nodes
    if variant == "p2p":            # each rank sends 2 n / p to every rank of other nodes
        return 2 * per_node * (p - per_node) * n / p
    return None


def fit_seconds(fit: dict, variant: str, p: int, n: float, servers: int = 1,
                nodes: int = 1) -> float:
    """mpidist's fitted alpha, beta, gamma with the variant's step and byte counts."""
    alpha, beta, gamma = fit["alpha"], fit["beta"], fit["gamma"]
    if variant == "ps":
        a, b, g = 2.0, link_bytes("ps", p, 1.0, servers), p / servers
    elif variant in ("p2p", "ring", "native"):
        a, b, g = 2.0 * (p - 1) if variant != "p2p" else 2.0, 2 * (p - 1) / p, (p - 1) / p
    else:                                       # hierarchical: the inter-node ring's share
        a, b, g = 2.0 * (nodes - 1), 2 * (nodes - 1) / nodes, (nodes - 1) / nodes
    return a * alpha + b * n * beta + g * n * gamma


def fit_of(model: dict, level: str = "world") -> dict:
    """The ring's alpha, beta and the reduction's gamma from a cost-model probe's JSON."""
    lv = model["levels"][level]
    alpha, beta = lv["fits"]["ring"]
    return {"alpha": alpha, "beta": beta, "gamma": lv["gamma"]}
