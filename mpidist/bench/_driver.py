"""The driver the torch benchmarks share: alone, a benchmark starts one MPI job per rank
count (or one on a simulated cluster, --cluster NODESxRANKS --bandwidth RATE), each running
its own worker (`mpidist bench NAME --worker --json PATH ...`), and reports the rows it
collects; under mpiexec (or with --worker) it is that worker.
See docs/BENCHMARKS.md."""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile

from mpidist.launcher import run
from mpidist.simcluster import NIC, SimCluster

__all__ = ["add_cluster_options", "add_worker_options", "parse_cluster", "drive", "free_port",
           "init_gloo", "launched", "on_cluster", "without_cluster_options", "in_build_order",
           "BUILD_ORDERS"]

BUILD_ORDERS = ("forward", "reverse")


def free_port() -> int:
    """A TCP port nobody listens on now, on this host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(comm) -> None:
    """Collective: torch.distributed's gloo group over comm's ranks, its rendezvous on
    MASTER_ADDR (the simulated cluster's node 0; else this host) and a port rank 0 picked."""
    import torch.distributed as dist    # optional: the torch benchmarks need it
    port = comm.comm.bcast(free_port() if comm.rank == 0 else None, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)


def launched() -> bool:
    return any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def add_cluster_options(parser) -> None:
    """--cluster NODESxRANKS and --bandwidth RATE, for a benchmark that can run on the
    simulated cluster (scripts/sim_cluster.sh; root and network namespaces)."""
    parser.add_argument("--cluster", default=None, type=parse_cluster,
                        help="run on a simulated cluster of NODESxRANKS (e.g. 2x1), gloo on its NIC")
    parser.add_argument("--bandwidth", default="1gbit",
                        help="the simulated nodes' link rate, tc syntax (default 1gbit)")


def add_worker_options(parser, build_order: bool = False) -> None:
    """--worker and --json PATH: what the driver passes to the rank processes it starts;
    with build_order, --build-order (drive's merge)."""
    parser.add_argument("--worker", action="store_true",
                        help="measure at the current world size (under mpiexec)")
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    if build_order:
        parser.add_argument("--build-order", default=BUILD_ORDERS[0], choices=BUILD_ORDERS,
                            help="the order the variants are built in, in this job (alone, "
                                 "the benchmark runs one job in each order)")


def in_build_order(names, args) -> list:
    """names in the order args.build_order says (BUILD_ORDERS: as given, or reversed)."""
    names = list(names)
    return names[::-1] if args.build_order == "reverse" else names


def without_cluster_options(argv: list[str]) -> list[str]:
    """argv less --cluster and --bandwidth with their values (for the command run on the
    cluster itself)."""
    out, it = [], iter(argv)
    for a in it:
        if a in ("--cluster", "--bandwidth"):
            next(it, None)
        elif not a.startswith(("--cluster=", "--bandwidth=")):
            out.append(a)
    return out


def parse_cluster(text: str) -> str:
    """'2x1' -> '2x1' (validated: nodes x ranks per node, each at least 1)."""
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", str(text))
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--cluster takes NODESxRANKS, e.g. 2x1, got {text!r}")
    return f"{int(m.group(1))}x{int(m.group(2))}"


def on_cluster(args, argv: list[str]):
    """Run argv on the simulated cluster args.cluster; gloo's rendezvous on node 0's address
    and its traffic on the cluster NIC (else it binds to loopback and never connects)."""
    nodes, per_node = (int(v) for v in args.cluster.split("x"))
    with SimCluster(nodes, per_node, args.bandwidth) as cluster:
        env = {**os.environ, "MASTER_ADDR": "10.231.0.1", "GLOO_SOCKET_IFNAME": NIC}
        return cluster.run(argv, env=env, timeout=1800)


def drive(name: str, args, worker, report, worker_args: list[str], check=None,
          merge=None) -> int:
    """Run benchmark `name`: worker(args) -> row on every rank of this job, or one job per
    rank count in args.ranks (one on the simulated cluster with args.cluster) with
    worker_args; report(rows, args) -> the table's text, printed and written with the rows to
    args.out/NAME.{json,txt}. check(rows) -> why the rows are void, or None: the benchmark
    then exits 1 after its report.

    merge(rows) -> row: the worker builds its variants in the order --build-order names
    (BUILD_ORDERS); each rank count then runs one job per order and merge combines their
    rows. Where variants take turns in one process, the one built first can run slower
    after a turn of another, so a fixed order would favour a variant."""
    try:
        import torch  # noqa: F401  (optional: the benchmark needs it, mpidist does not)
    except ImportError:
        print(f"mpidist bench {name} needs PyTorch: pip install 'mpidist[torch]'", file=sys.stderr)
        return 2
    if args.worker or launched():
        result = worker(args)
        from mpi4py import MPI       # here, not at the top: the driver process starts the ranks
        if MPI.COMM_WORLD.Get_rank() == 0:
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(result, fh, indent=1)
            else:
                print(report([result], args))
        why = check([result]) if check else None
        return 1 if why else 0
    rows = []
    cluster = getattr(args, "cluster", None)
    orders = [["--build-order", o] for o in BUILD_ORDERS] if merge else [[]]
    for n in [cluster] if cluster else [int(r) for r in args.ranks.split(",")]:
        got = []
        for order in orders:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "result.json")
                argv = [sys.executable, "-m", "mpidist", "bench", name, "--worker", "--json",
                        path, *worker_args, *order]
                proc = on_cluster(args, argv) if cluster else run(n, argv, timeout=1800)
                if proc.returncode != 0 and not os.path.exists(path):
                    raise RuntimeError(f"the {n}-rank measurement failed (exit "
                                       f"{proc.returncode})")
                with open(path) as fh:
                    got.append(json.load(fh))
        rows.append(merge(got) if merge else got[0])
    text = report(rows, args)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as fh:
        json.dump({"rows": rows, "args": vars(args)}, fh, indent=1)
    with open(os.path.join(args.out, f"{name}.txt"), "w") as fh:
        fh.write(text + "\n")
    print(f"wrote {args.out}/{name}.{{json,txt}}")
    why = check(rows) if check else None
    if why:
        print(f"mpidist bench {name}: FAILED: {why}", file=sys.stderr)
        return 1
    return 0
