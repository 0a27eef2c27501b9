"""Parameter server vs peer-to-peer vs ring vs hierarchical allreduce on the simulated cluster.

Seed 003's claims: ring allreduce decouples network usage from the number of workers; one
parameter server (PS) suffers congestion at the server; P2P (every worker serves a shard)
is better than one PS but still bottlenecked. The seed's text in shared/seeds holds its
abstract only, so its analytic model is written out here in its usual form, for a model of
n bytes, p workers, S servers and full-duplex links of B bytes/s (each node one NIC):
  one step of synchronous SGD moves, through the busiest NIC and direction,
    PS:   p n / S per phase, two phases (push, then pull)   T = 2 p n / (S B)
    P2P:  (p-1) n / p per phase (reduce-scatter by all-to-all, then all-gather)
                                                            T = 2 (p-1) n / (p B)
    ring: 2 (p-1) n / p in 2 (p-1) steps                    T = 2 (p-1) n / (p B)
    hierarchical, N nodes x L ranks: 2 (N-1) n / N per NIC  T = 2 (N-1) n / (N B)
                  (flat ring over the same ranks:           2 (NL-1) n / (NL) per NIC)
Beside it, mpidist's own alpha-beta(-gamma) fit (the cost model's probe on the
cluster) predicts each as a alpha + b n beta + g n gamma with the same counts a, b, g.

Phase A: 1 rank per node, p = 2..W workers: 1 PS, 2 PS, P2P, ring.
Phase B: N nodes x 2 ranks: flat ring, hierarchical, P2P, MPI_Allreduce.
Phase C: compute and communication overlapped (allreduce_async per layer) or not.
Measured per step: the slowest rank's time (median over rounds) and every NIC's bytes.
"""
from __future__ import annotations

import time

import numpy as np

from experiments import common

NAME = "architectures"


# ---------------------------------------------------------------------- the models
def seed_bytes(variant: str, p: int, n: float, servers: int = 1) -> float:
    """Bytes through the busiest NIC in its busier direction, per step (seed's model)."""
    if variant == "ps":             # a server receives p n / S, then sends p n / S
        return max(p * n / servers, n)          # a worker's own link bounds it
    if variant in ("p2p", "ring", "native"):
        return 2 * (p - 1) * n / p
    raise ValueError(variant)


def seed_seconds(variant: str, p: int, n: float, rate: float, servers: int = 1) -> float:
    """The seed model's communication time per step at link rate `rate` bytes/s: the PS's
    push and pull phases follow each other, so its link time counts twice."""
    return seed_bytes(variant, p, n, servers) * (2 if variant == "ps" else 1) / rate


def node_bytes(variant: str, nodes: int, per_node: int, n: float) -> float | None:
    """Phase B, block placement: bytes out of each node's NIC per allreduce (seed's model;
    None for MPI_Allreduce, whose algorithm is the library's choice)."""
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
        a, b, g = 2.0, seed_bytes("ps", p, 1.0, servers), p / servers
    elif variant in ("p2p", "ring", "native"):
        a, b, g = 2.0 * (p - 1) if variant != "p2p" else 2.0, 2 * (p - 1) / p, (p - 1) / p
    else:                                       # hierarchical: the inter-node ring's share
        a, b, g = 2.0 * (nodes - 1), 2 * (nodes - 1) / nodes, (nodes - 1) / nodes
    return a * alpha + b * n * beta + g * n * gamma


# ---------------------------------------------------------------------- the worker (MPI)
def _p2p_allreduce(comm, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """P2P: every worker serves one shard. 1. all-to-all: shard j of every gradient goes to
    worker j; 2. worker j sums its p copies; 3. all-to-all again: every worker sends its
    summed shard to every other (each pair talks directly, no ring, no tree)."""
    from mpi4py import MPI
    from mpidist.partition import chunk
    p, me = comm.size, comm.rank
    parts = [chunk(x.size, r, p) for r in range(p)]
    counts = np.array([c for _, c in parts])
    displs = np.array([o for o, _ in parts])
    mine = counts[me]
    t = MPI.FLOAT if x.dtype == np.float32 else MPI.DOUBLE
    # 1. reduce-scatter by all-to-all
    recv = np.empty(p * mine, x.dtype)
    comm.comm.Alltoallv([x, counts, displs, t], [recv, [mine] * p, [mine * r for r in range(p)], t])
    # 2. my shard's sum
    shard = recv.reshape(p, mine).sum(axis=0, dtype=x.dtype)
    # 3. all-gather by all-to-all
    comm.comm.Alltoallv([shard, [mine] * p, [0] * p, t], [out, counts, displs, t])
    return out


def _sub(world, members: int):
    from mpi4py import MPI
    from mpidist.comm import Communicator
    mpi = world.comm.Split(0 if world.rank < members else MPI.UNDEFINED, world.rank)
    if mpi == MPI.COMM_NULL:
        return None
    sub = Communicator(mpi)
    mpi.Free()
    return sub


def _measure(world, subs, variant: str, members: int, servers: int, n: int, iters: int):
    """(seconds per step on the slowest rank, [tx, rx] per step of every world rank's NIC)."""
    from mpidist.collectives import allreduce
    from mpidist.ps import ParameterServer
    from mpidist.simcluster import nic_bytes
    from mpi4py import MPI
    sub = subs[members]
    seconds, before, after = None, None, None
    if sub is not None:
        x = np.ones(n, np.float32)
        out = np.empty_like(x)
        if variant == "ps":
            with ParameterServer(np.zeros(n, np.float32), comm=sub, servers=servers,
                                 average=False, timeout=300) as ps:
                before = nic_bytes()
                sub.comm.Barrier()
                t0 = time.perf_counter()
                if ps.is_server:
                    ps.serve()
                else:
                    for _ in range(iters):
                        ps.worker.pull(out=out)
                        ps.worker.push(x)
                    ps.worker.finish()
                sub.comm.Barrier()
                seconds = time.perf_counter() - t0
                after = nic_bytes()
        else:
            run = {"ring": lambda: allreduce(x, algorithm="ring", comm=sub, out=out),
                   "hierarchical": lambda: allreduce(x, algorithm="hierarchical", comm=sub, out=out),
                   "native": lambda: sub.comm.Allreduce(x, out, MPI.SUM),
                   "p2p": lambda: _p2p_allreduce(sub, x, out)}[variant]
            run()                                          # warm: connections, JIT
            before = nic_bytes()
            sub.comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            sub.comm.Barrier()
            seconds = time.perf_counter() - t0
            after = nic_bytes()
    t = max(s for s in world.comm.allgather(seconds) if s is not None) / iters
    nic = None if before is None or after is None or world.local_rank != 0 else \
        [(after[0] - before[0]) / iters, (after[1] - before[1]) / iters]
    return t, world.comm.allgather(nic)


def _overlap(world, n: int, iters: int, rounds: int, layers: int = 8) -> dict:
    """Phase C: a step = backward over `layers` equal layers, then the gradient allreduce.
    Compute is a wait (the host is free meanwhile, as while an accelerator computes), as
    long as one ring allreduce of the whole gradient. Sequential: all layers, then one
    ring allreduce (how a PS or P2P step runs: pull, compute, push). Overlapped: each
    layer's gradient goes out by allreduce_async as soon as it is done, and the step waits
    for all at the end (mpidist's data-parallel buckets)."""
    from mpidist.collectives import allreduce, allreduce_async
    round_order = common.costmodel().round_order
    g = np.ones(n, np.float32)
    parts = np.array_split(g, layers)
    comm_t = []
    for _ in range(5):
        world.comm.Barrier()
        t0 = time.perf_counter()
        allreduce(g, algorithm="ring", comm=world)
        comm_t.append(time.perf_counter() - t0)
    compute = float(world.comm.bcast(np.median(comm_t[1:]), root=0))

    def sequential():
        for _ in range(layers):
            time.sleep(compute / layers)
        allreduce(g, algorithm="ring", comm=world)

    def overlapped():
        handles = []
        for part in reversed(parts):            # backward: the last layer's gradient first
            time.sleep(compute / layers)
            handles.append(allreduce_async(part, algorithm="ring", comm=world))
        for h in handles:
            h.wait()

    def comm_only():
        allreduce(g, algorithm="ring", comm=world)

    def compute_only():                          # a loaded host wakes late from each wait
        for _ in range(layers):
            time.sleep(compute / layers)

    calls = {"sequential": sequential, "overlapped": overlapped, "comm only": comm_only,
             "compute only": compute_only}
    times = {k: [] for k in calls}
    for r in range(rounds * iters):
        for j in round_order(len(calls), r, seed=11):
            name = list(calls)[j]
            world.comm.Barrier()
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(max(world.comm.allgather(time.perf_counter() - t0)))
    from mpi4py import MPI
    return {"compute_s": compute, "layers": layers, "times": times,
            "threaded": MPI.Query_thread() == MPI.THREAD_MULTIPLE}


def _worker(args) -> None:
    from mpidist.comm import Communicator
    probe, round_order = common.costmodel().probe, common.costmodel().round_order
    w = dict(kv.split("=") for kv in args.worker.split(","))
    phase, n, iters, rounds = w["phase"], int(w["n"]), int(w["iters"]), int(w["rounds"])
    world = Communicator()
    if phase == "C":
        result = _overlap(world, n, iters, rounds)
        if world.rank == 0:
            common.emit(result)
        world.free()
        return
    if phase == "A":
        W = int(w["workers"])
        cases = [(v, p, s, p + s if v == "ps" else p) for p in range(2, W + 1)
                 for v, s in (("ps", 1), ("ps", 2), ("p2p", 0), ("ring", 0))]
    else:
        cases = [(v, world.size, 0, world.size) for v in ("ring", "hierarchical", "p2p", "native")]
    subs = {m: _sub(world, m) for m in sorted({c[3] for c in cases})}
    samples = {i: [] for i in range(len(cases))}
    nics = {i: [] for i in range(len(cases))}
    for r in range(rounds):                        # interleaved, shuffled the same everywhere
        for i in round_order(len(cases), r, seed=7):
            v, p, s, m = cases[i]
            t, nic = _measure(world, subs, v, m, s, n, iters)
            samples[i].append(t)
            nics[i].append(nic)
    # mpidist's alpha-beta fit on the widest ring of the phase (and its link levels)
    fit_comm = subs[max(subs)]
    model = None
    if fit_comm is not None:
        sizes = tuple(sorted({max(4096, n * 4 // 16), n * 4 // 4, n * 4}))
        model = probe(fit_comm, sizes=sizes, reps=3, seconds=float(w["probe_s"])).to_json()
    model = world.comm.bcast(model, root=0)
    for sub in subs.values():
        if sub is not None:
            sub.free()
    if world.rank == 0:
        rows = []
        for i, (v, p, s, m) in enumerate(cases):
            rows.append({"variant": v, "workers": p, "servers": s, "members": m,
                         "seconds": samples[i], "nic": nics[i]})
        common.emit({"cases": rows, "model": model, "nodes": world.num_nodes,
                     "per_node": world.local_size, "n": n, "iters": iters})
    world.free()


# ---------------------------------------------------------------------- the driver
def _busiest(nic_rounds: list) -> tuple[float, float]:
    """(median bytes of the busiest NIC in its busier direction, the same for tx+rx)."""
    one, both = [], []
    for nic in nic_rounds:
        live = [x for x in nic if x is not None]
        one.append(max(max(t, r) for t, r in live))
        both.append(max(t + r for t, r in live))
    return float(np.median(one)), float(np.median(both))


def _fit_of(model: dict, level: str = "world") -> dict:
    lv = model["levels"][level]
    alpha, beta = lv["fits"]["ring"]
    return {"alpha": alpha, "beta": beta, "gamma": lv["gamma"]}


def _rows(result: dict, phase: str, rate_Bps: float) -> list[dict]:
    CostModel = common.costmodel().CostModel
    nbytes = result["n"] * 4
    fit = _fit_of(result["model"])
    cm = CostModel.from_json(result["model"])
    out = []
    for c in result["cases"]:
        v, p, s = c["variant"], c["workers"], c["servers"]
        sec = np.array(c["seconds"])
        busy, busy2 = _busiest(c["nic"])
        nodes = result["nodes"]
        sb = seed_bytes(v, p, nbytes, max(s, 1)) if phase == "A" else \
            node_bytes(v, nodes, result["per_node"], nbytes)
        if phase == "B" and v in ("ring", "native", "p2p"):
            pred_fit = cm.predict(v, nbytes) if v != "p2p" else None
        elif phase == "B":
            pred_fit = cm.predict("hierarchical", nbytes)
        else:
            pred_fit = fit_seconds(fit, v, p, nbytes, max(s, 1))
        label = f"{s} PS" if v == "ps" else v
        out.append({"phase": phase, "variant": label, "workers": p,
                    "nodes": nodes if phase == "B" else c["members"],
                    "ranks_per_node": result["per_node"], "model_MiB": nbytes / 2**20,
                    "step_s": float(np.median(sec)), "step_s_min": float(sec.min()),
                    "step_s_max": float(sec.max()), "busiest_nic_MB": busy / 1e6,
                    "busiest_nic_txrx_MB": busy2 / 1e6,
                    "seed_model_MB": None if sb is None else sb / 1e6,
                    "seed_model_s": None if sb is None else
                    seed_seconds(v, p, nbytes, rate_Bps, max(s, 1)) if phase == "A" else
                    sb / rate_Bps,
                    "fit_model_s": pred_fit})
    return out


def _rows_c(res: dict, workers: int, nbytes: int) -> list[dict]:
    out = []
    for name, ts in res["times"].items():
        ts = np.array(ts)
        out.append({"phase": "C", "variant": f"ring, {name}", "workers": workers,
                    "nodes": workers, "ranks_per_node": 1, "model_MiB": nbytes / 2**20,
                    "step_s": float(np.median(ts)), "step_s_min": float(ts.min()),
                    "step_s_max": float(ts.max()),
                    "compute_s": 0.0 if name == "comm only" else res["compute_s"],  # nominal
                    "layers": res["layers"], "threaded": res["threaded"]})
    return out


def hidden_fractions(res_c: dict) -> list[float]:
    """Per interleaved sample: the share of the shorter of compute and communication that
    the overlapped step hid, (compute + comm - overlapped) / min(compute, comm)."""
    t = {k: np.array(v) for k, v in res_c["times"].items()}
    return list((t["compute only"] + t["comm only"] - t["overlapped"])
                / np.minimum(t["compute only"], t["comm only"]))


def _plot(rows_a, rows_b, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    colors = {"1 PS": "C3", "2 PS": "C1", "p2p": "C0", "ring": "C2"}
    for label, color in colors.items():
        rs = [r for r in rows_a if r["variant"] == label]
        if not rs:
            continue
        p = [r["workers"] for r in rs]
        axes[0].errorbar(p, [r["step_s"] for r in rs],
                         yerr=[[r["step_s"] - r["step_s_min"] for r in rs],
                               [r["step_s_max"] - r["step_s"] for r in rs]],
                         fmt="o-", color=color, label=f"{label} measured", capsize=3)
        axes[0].plot(p, [r["seed_model_s"] for r in rs], "--", color=color, alpha=0.7)
        axes[0].plot(p, [r["fit_model_s"] for r in rs], ":", color=color, alpha=0.9)
        axes[1].plot(p, [r["busiest_nic_MB"] for r in rs], "o-", color=color, label=label)
        axes[1].plot(p, [r["seed_model_MB"] for r in rs], "--", color=color, alpha=0.7)
    axes[0].set(xlabel="workers p (one per node)", ylabel="seconds per synchronous step",
                title="step time: measured (bars: min-max over rounds),\nseed model --, "
                      "mpidist alpha-beta fit ..")
    axes[1].set(xlabel="workers p", ylabel="MB per step, busiest NIC, busier direction",
                title="bytes on the busiest link: measured, seed model --")
    for ax in axes[:2]:
        ax.set_xticks(sorted({r["workers"] for r in rows_a}))
        ax.legend(fontsize=7)
    labels = [r["variant"] for r in rows_b]
    x = np.arange(len(rows_b))
    axes[2].bar(x - 0.27, [r["step_s"] for r in rows_b], 0.27, label="measured", color="C0")
    axes[2].bar(x, [r["seed_model_s"] or 0 for r in rows_b], 0.27, label="seed model",
                color="C7")
    axes[2].bar(x + 0.27, [r["fit_model_s"] or 0 for r in rows_b], 0.27,
                label="mpidist fit", color="C9")
    axes[2].set_xticks(x, labels)
    if rows_b:
        axes[2].set_title(f"{rows_b[0]['nodes']} nodes x {rows_b[0]['ranks_per_node']} ranks: "
                          f"one allreduce", fontsize=10)
    axes[2].set_ylabel("seconds")
    axes[2].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ratio(rows, variant, key, p_hi, p_lo):
    get = {r["workers"]: r[key] for r in rows if r["variant"] == variant}
    return get[p_hi] / get[p_lo]


def _section(rows_a, rows_b, rows_c, args, out, bw: str, cfg: dict) -> str:
    W = max(r["workers"] for r in rows_a)
    at = {(r["variant"], r["workers"]): r for r in rows_a}
    ring_b = _ratio(rows_a, "ring", "busiest_nic_MB", W, 2)
    ps_b = _ratio(rows_a, "1 PS", "busiest_nic_MB", W, 2)
    ring_t = _ratio(rows_a, "ring", "step_s", W, 2)
    ps_t = _ratio(rows_a, "1 PS", "step_s", W, 2)
    p2p, ring, ps1 = at[("p2p", W)], at[("ring", W)], at[("1 PS", W)]
    noise = max(max(r["step_s_max"] / r["step_s"] - 1, 1 - r["step_s_min"] / r["step_s"])
                for r in rows_a + rows_b)
    noise_text = (f"the rounds' min-max spread is within {noise * 100:.0f}% of the median; a "
                  f"rerun reproduces the table within about that" if cfg["rounds"] > 1 else
                  "one round only (--quick): no spread measured")
    fit_err = np.median([abs(r["fit_model_s"] / r["step_s"] - 1) for r in rows_a])

    def err(model: str, servers: bool) -> float:
        key = "seed_model_s" if model == "seed" else "fit_model_s"
        return 100 * float(np.median([abs(r[key] / r["step_s"] - 1) for r in rows_a
                                      if r["variant"].endswith("PS") == servers]))
    seed_err = np.median([abs(r["seed_model_s"] / r["step_s"] - 1) for r in rows_a])
    decoupled = ring_b <= 2 * (W - 1) / W * 1.15 and ps_b >= 0.8 * W / 2
    b = {r["variant"]: r for r in rows_b}
    hier_gain = 1 - b["hierarchical"]["busiest_nic_MB"] / b["ring"]["busiest_nic_MB"]
    hier_t = b["ring"]["step_s"] / b["hierarchical"]["step_s"]
    p2p_vs_ring = p2p["step_s"] / ring["step_s"]
    p2p_bytes = p2p["busiest_nic_MB"] / ring["busiest_nic_MB"]
    tab = ["| phase | variant | workers | step s (median; min-max) | busiest NIC MB/step | "
           "seed model MB/step | seed model s | mpidist fit s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows_a + rows_b:
        f3 = lambda v: "-" if v is None else f"{v:.3f}"
        f2 = lambda v: "-" if v is None else f"{v:.2f}"
        tab.append(f"| {r['phase']} | {r['variant']} | {r['workers']} | {r['step_s']:.3f} "
                   f"({r['step_s_min']:.3f}-{r['step_s_max']:.3f}) | {r['busiest_nic_MB']:.2f} | "
                   f"{f2(r['seed_model_MB'])} | {f3(r['seed_model_s'])} | {f3(r['fit_model_s'])} |")
    nb = rows_b[0]
    c = {r["variant"].split(", ")[1]: r for r in rows_c}
    fractions = cfg["hidden"]
    hidden = float(np.median(fractions))
    hid_some = sum(f >= 0.2 for f in fractions)
    for r in rows_c:
        tab.append(f"| C | {r['variant']} | {r['workers']} | {r['step_s']:.3f} "
                   f"({r['step_s_min']:.3f}-{r['step_s_max']:.3f}) | | | | |")
    return f"""## 1. Parameter server vs P2P vs ring vs hierarchical (seed 003)

**Claim.** Ring allreduce "decouples network usage from the number of workers"; one
parameter server suffers congestion at the server; P2P is better than one PS but still
bottlenecked (the seed's analytic model of synchronous SGD, checked against TensorFlow and
Horovod).

**Setup.** The simulated cluster (`mpidist.simcluster`): one network namespace per node,
one veth NIC each, shaped to {bw} full duplex by `tc tbf` (no added latency: `netem` is
not in this kernel), all behind one Linux bridge; Open MPI 4.1 over TCP between nodes,
shared memory within. Phase A: one rank per node, p = 2..{W} workers, a
{rows_a[0]['model_MiB']:.2f} MiB float32 model, {cfg['iters']} synchronous steps per sample,
{cfg['rounds']} rounds with the variants interleaved in a shuffled order: one server (p + 1
nodes), two servers (p + 2 nodes; mpidist's `ParameterServer`, BSP, passive-target RMA),
P2P (each worker serves one shard: reduce-scatter and all-gather by `MPI_Alltoallv`) and
mpidist's ring. Phase B: {nb['nodes']} nodes x {nb['ranks_per_node']} ranks, one allreduce
of the same model: flat ring, hierarchical (intra-node reduce-scatter, inter-node ring,
intra-node all-gather), P2P and Open MPI's `MPI_Allreduce`. Phase C: phase A's {W}
workers, a backward pass of 8 equal layers simulated by a wait as long as one ring
allreduce (the host is free, as while an accelerator computes), then the ring allreduce,
either after the whole backward or layer by layer with `allreduce_async` (at
MPI_THREAD_MULTIPLE). Bytes are the NICs' own
counters (`/sys/class/net/sim0/statistics`). The seed model is the formula in
`experiments/architectures.py` at the shaped rate; the fit is mpidist's
cost-model probe (`collectives/tuning/costmodel.py`) on the cluster (alpha {cfg['fit']['alpha'] * 1e3:.2f} ms,
beta {1 / cfg['fit']['beta'] / 1e6 if cfg['fit']['beta'] else float('inf'):.1f} MB/s for the ring over nodes).
Machine: {common.machine()}; a shared 2-core VM, so CPU-bound parts are noisy.

**Command.** `{common.command_line(NAME, args)}` (root; {cfg['took']:.0f} s).

![architectures]({out.figure_link()})

{chr(10).join(tab)}

**Verdict.**
- Network usage: from 2 to {W} workers the ring's busiest NIC carries {ring_b:.2f}x the bytes
  per step (model {(W - 1) / W * 2:.2f}x), one server's {ps_b:.2f}x (model {W / 2:.2f}x):
  {'the ring does decouple link load from the worker count and the single server does congest, as claimed' if decoupled else 'this does NOT match the claim as stated; see the table'}.
  Step time grows {ring_t:.2f}x for the ring and {ps_t:.2f}x for one server.
- P2P at {W} workers: {p2p['step_s']:.3f} s against the ring's {ring['step_s']:.3f} s
  ({p2p_vs_ring:.2f}x) and one server's {ps1['step_s']:.3f} s. {'P2P is better than one PS, as claimed; ' if p2p['step_s'] < ps1['step_s'] else 'P2P is NOT better than one PS here; '}{'but it is not bottlenecked beyond the ring: on a bridge (a non-blocking switch with per-port shaping) the all-to-all moves the same 2(p-1)/p bytes per NIC as the ring, so the seed’s P2P bottleneck does not reproduce here.' if p2p_vs_ring < 1.25 else f'and it is slower than the ring, as claimed, though its busiest NIC carries only {p2p_bytes:.2f}x the ring’s bytes: the extra time is the all-to-all’s p-1 simultaneous flows into every port’s queue (TCP incast), not the byte count the model counts.'}
- Hierarchical, {nb['nodes']} x {nb['ranks_per_node']}: {hier_gain * 100:.0f}% fewer bytes on the busiest
  NIC than the flat ring (model {(1 - (2 * (nb['nodes'] - 1) / nb['nodes']) / (2 * (nb['workers'] - 1) / nb['workers'])) * 100:.0f}%), {hier_t:.2f}x the flat ring's speed.
- Models (median error over phase A): the seed's bandwidth-only model is off by
  {seed_err * 100:.0f}% ({err('seed', True):.0f}% on the servers, {err('seed', False):.0f}% on ring and P2P),
  mpidist's fitted alpha-beta model by {fit_err * 100:.0f}% ({err('fit', True):.0f}% on the servers,
  {err('fit', False):.0f}% on ring and P2P). The seed model has no per-message cost, so it
  undershoots the ring and P2P; the fit, from the ring's own allreduces at a few sizes (a
  short probe on this loaded VM), {'follows them more closely' if err('fit', False) < err('seed', False) else 'does not follow them more closely here'},
  and its per-byte cost is the ring's, which overlaps sending and receiving, while a
  parameter server's push and pull go one after the other through one-sided calls.
- Overlap (phase C, {W} workers, compute = a wait as long as one ring allreduce,
  {c['overlapped']['layers']} layers): compute then ring {c['sequential']['step_s']:.3f} s,
  each layer's gradient sent by `allreduce_async` as backward goes {c['overlapped']['step_s']:.3f} s,
  communication alone {c['comm only']['step_s']:.3f} s, compute alone {c['compute only']['step_s']:.3f} s
  (medians). Per interleaved sample, the overlapped step hid {hidden * 100:.0f}% (median;
  {min(fractions) * 100:.0f}% to {max(fractions) * 100:.0f}%) of the shorter of the two, at least 20% in
  {hid_some} of {len(fractions)} samples: {'the ring does overlap, as claimed' if hidden >= 0.3 and hid_some > len(fractions) / 2 else 'the overlap does NOT reproduce reliably here'}. On 2 shared cores the
  per-layer allreduces run on a Python worker thread that must win a core from the other
  jobs, and 8 allreduces of an eighth pay 8x the ring's per-message steps, so what is hidden
  swings with the load from run to run; mpidist's parameter-server
  worker runs pull, compute, push in turn, so it hides nothing by construction (its step is
  compute plus phase A's time), which is the seed's point about PS.
- Noise: {noise_text}.
"""


def main(argv=None) -> int:
    args = common.parser(NAME, __doc__).parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    common.need_cluster()
    from mpidist.simcluster import SimCluster, parse_rate
    out = common.Outputs(NAME, args)
    bw = "100mbit"
    rate = parse_rate(bw) / 8
    if args.quick:
        cfg = {"W": 3, "n": 1 << 16, "iters": 2, "rounds": 1, "probe_s": 2, "nodes_b": 2}
    else:
        cfg = {"W": 4, "n": 1 << 19, "iters": 3, "rounds": 3, "probe_s": 8, "nodes_b": 3}
    t0 = time.perf_counter()
    spec = (f"n={cfg['n']},iters={cfg['iters']},rounds={cfg['rounds']},"
            f"probe_s={cfg['probe_s']}")
    with SimCluster(nodes=cfg["W"] + 2, ranks_per_node=1, bandwidth=bw) as cluster:
        res_a = common.run_cluster(NAME, cluster, [f"phase=A,workers={cfg['W']}," + spec],
                                   timeout=1800, what="phase A", thread_level="serialized")
        # the overlap needs MPI_THREAD_MULTIPLE (allreduce_async's worker thread)
        res_c = common.run_cluster(NAME, cluster, ["phase=C," + spec], np=cfg["W"],
                                   timeout=1800, what="phase C", thread_level="multiple")
    with SimCluster(nodes=cfg["nodes_b"], ranks_per_node=2, bandwidth=bw) as cluster:
        res_b = common.run_cluster(NAME, cluster, ["phase=B," + spec], timeout=1800,
                                   what="phase B", thread_level="serialized")
    cfg["took"] = time.perf_counter() - t0
    cfg["fit"] = _fit_of(res_a["model"])
    cfg["hidden"] = hidden_fractions(res_c)
    rows_a, rows_b = _rows(res_a, "A", rate), _rows(res_b, "B", rate)
    rows_c = _rows_c(res_c, cfg["W"], res_a["n"] * 4)
    out.write_csv(rows_a + rows_b + rows_c)
    _plot(rows_a, rows_b, out.png, f"simulated cluster, {bw} links, "
                                   f"{rows_a[0]['model_MiB']:.2f} MiB model")
    out.write_section(_section(rows_a, rows_b, rows_c, args, out, bw, cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
