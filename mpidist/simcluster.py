"""A simulated multi-node cluster on one Linux machine: network namespaces as nodes.

    python -m mpidist.simcluster --nodes 2 --ranks-per-node 2 --bandwidth 1gbit -- mpidist info
    scripts/sim_cluster.sh --nodes 3 --ranks-per-node 1 --bandwidth 100mbit -- python job.py

Each node is a namespace with one NIC on a shared bridge, its bandwidth shaped with `tc`, and
a hostname of its own, so MPI and mpidist's node detection see distinct hosts; ranks start
under the `mpiexec` on PATH (Open MPI's or MPICH's Hydra) and talk TCP between nodes and
shared memory within one. Root only; nothing is added to the machine's own network
namespace, and everything is torn down on close(). Layout and limits: SimCluster's;
docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from mpidist import threads
from mpidist.launcher import REMOTE_LAUNCH, mpi_env, mpi_vendor, mpiexec_argv, remote_launch

__all__ = ["SimCluster", "unavailable_reason", "parse_rate", "nic_bytes", "cleanup_stale",
           "NIC", "SUBNET", "main"]

NIC = "sim0"                      # every node's cluster NIC
SUBNET = "10.231.0.0/24"          # only inside the cluster's own namespaces
PREFIX = "mpsim"                  # namespace names: mpsim<owner pid>x<k>-hub / -n<i>
ENV_NODE = "MPIDIST_SIMCLUSTER_NODE"
_serial = itertools.count()
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$")
_AGENT = r"""#!/bin/sh
# mpiexec's ssh agent for a simulated cluster: `agent [options] HOST COMMAND...` runs
# COMMAND in HOST's network namespace, with that node's hostname, instead of over ssh.
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
ns=$(cat "%(hosts)s/$host") || { echo "simcluster agent: unknown host $host" >&2; exit 1; }
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$1"; shift; exec /bin/sh -c "$*"' \
    agent "$ns" "$@"
"""


def parse_rate(rate: str | None) -> float | None:
    """'100mbit' / '1gbit' / '500kbit' -> bits per second; None or 'none' -> None."""
    if rate is None or str(rate).strip().lower() in ("", "none"):
        return None
    m = _RATE.match(str(rate).strip().lower())
    if not m:
        raise ValueError(f"bandwidth must look like 100mbit, 1gbit or 500kbit (tc's rate "
                         f"syntax), or none for unshaped links; got {rate!r}")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    if value <= 0:
        raise ValueError(f"bandwidth must be positive, got {rate!r}")
    return value


def _run(argv, check=True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise RuntimeError(f"simulated cluster: `{' '.join(argv)}` failed "
                           f"(exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str | None:
    """Why a simulated cluster can not be made here (None when it can): Linux, root,
    iproute2 (ip, tc), util-linux unshare, Open MPI's or MPICH's mpiexec, and a namespace
    that really gets created."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run as root, or in a container " \
               "with CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if not shutil.which(tool):
            return f"`{tool}` not found: install {pkg}"
    try:
        if mpi_vendor() not in REMOTE_LAUNCH:
            return "the simulated cluster launches through Open MPI's or MPICH's mpiexec; " \
                   "mpiexec here is neither"
    except RuntimeError as exc:
        return str(exc)
    probe = f"{PREFIX}{os.getpid()}probe"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"could not create a network namespace: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in network namespace ns, then delete it."""
    for _ in range(3):
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)
    _run(["ip", "netns", "del", ns], check=False)


def cleanup_stale() -> list[str]:
    """Delete simulated-cluster namespaces whose owner process is gone; returns their names."""
    gone = []
    for ns in _namespaces():
        m = re.match(rf"^{PREFIX}(\d+)x\d+-", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _kill_namespace(ns)
            gone.append(ns)
    return gone


def nic_bytes() -> tuple[int, int] | None:
    """(tx, rx) bytes of this node's cluster NIC so far; None outside a simulated node."""
    base = f"/sys/class/net/{NIC}/statistics"
    try:
        with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
            return int(tx.read()), int(rx.read())
    except OSError:
        return None


class SimCluster:
    """N nodes x L ranks as network namespaces; use as a context manager.

    Layout (root only):
      1. a hub namespace holding one bridge, the cluster's switch;
      2. per node a namespace with one veth NIC (`sim0`, address 10.231.0.<i+1>/24) whose
         other end is a port of the bridge, and its own loopback;
      3. per-link bandwidth: a `tc tbf` token bucket on both ends of every veth (the node's
         egress and the switch's egress towards it), so each node has a full-duplex NIC of
         that rate; tbf adds no latency (`netem`, which would, is not in every kernel).
    mpiexec runs in node 0's namespace with the node addresses as its hosts; its ssh
    launcher gets an agent script that runs `ip netns exec NODE` where it would run ssh.
    Between nodes the ranks talk TCP over `sim0`, within a node shared memory
    (launcher.remote_launch). Every node also gets a hostname of its own (a UTS namespace).

    One-sided windows (the parameter server) between nodes go through Open MPI 4.1's osc
    pt2pt, which refuses MPI_THREAD_MULTIPLE (mpi4py's default level): run such jobs with
    thread_level="serialized" (env MPI4PY_RC_THREAD_LEVEL). osc ucx, which would take the
    windows at THREAD_MULTIPLE, left the parameter server's pushes undelivered over TCP,
    so the cluster excludes it: window creation fails with Open MPI's message instead.
    MPICH takes them at any thread level.

    close() kills the processes left in the namespaces and deletes them; names carry the owner's
    pid, so `--cleanup` (and every new cluster) removes the leftovers of an owner that died.

        with SimCluster(nodes=2, ranks_per_node=2, bandwidth="1gbit") as cluster:
            cluster.run(["python", "-m", "mpidist", "info"], timeout=120)

    bandwidth: each node's NIC rate in tc syntax ("100mbit", "1gbit"), or None for
    unshaped veth links.
    """

    def __init__(self, nodes: int, ranks_per_node: int = 1, bandwidth: str | None = "1gbit"):
        for what, v in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{what} must be a positive int, got {v!r}")
        if nodes > 250:
            raise ValueError(f"at most 250 nodes fit the cluster's /24 subnet, got {nodes}")
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.bandwidth = None if parse_rate(bandwidth) is None else str(bandwidth).strip().lower()
        self.rate_bps = parse_rate(bandwidth)
        self.name = f"{PREFIX}{os.getpid()}x{next(_serial)}"
        self.hub = f"{self.name}-hub"
        self.node_ns = [f"{self.name}-n{i}" for i in range(nodes)]
        self.addresses = [f"10.231.0.{i + 1}" for i in range(nodes)]
        self.workdir: str | None = None
        self._made: list[str] = []

    @property
    def size(self) -> int:
        return self.nodes * self.ranks_per_node

    # ------------------------------------------------------------------ set-up
    def start(self) -> "SimCluster":
        """Create the namespaces, links, shaping and launcher files (RuntimeError, with the
        reason, where namespaces can not be made; a partial set-up is torn down)."""
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"cannot create a simulated cluster: {reason}")
        cleanup_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._made.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate_bps is None:
            return
        # the bucket holds 4 ms at the rate (at least 64 KiB, one GSO segment), the queue
        # up to 100 ms: a bottleneck link, not a lossy one
        burst = max(int(self.rate_bps / 8 * 0.004), 64 << 10)
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
              "rate", self.bandwidth, "burst", str(burst), "latency", "100ms"])

    def _create(self) -> None:
        # 1. the switch
        self._add_ns(self.hub)
        _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        # 2. the nodes and their links, 3. shaped at both ends
        self.workdir = tempfile.mkdtemp(prefix=f"{self.name}-")
        hosts = os.path.join(self.workdir, "hosts")
        os.makedirs(hosts)
        for i, (ns, addr) in enumerate(zip(self.node_ns, self.addresses)):
            self._add_ns(ns)
            port = f"p{i}"
            _run(["ip", "link", "add", port, "netns", self.hub, "type", "veth",
                  "peer", "name", NIC, "netns", ns])
            _run(["ip", "-n", self.hub, "link", "set", port, "master", "br0", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", NIC])
            _run(["ip", "-n", ns, "link", "set", NIC, "up"])
            self._shape(ns, NIC)
            self._shape(self.hub, port)
            with open(os.path.join(hosts, addr), "w") as fh:
                fh.write(ns + "\n")
        self.agent = os.path.join(self.workdir, "agent.sh")
        with open(self.agent, "w") as fh:
            fh.write(_AGENT % {"hosts": hosts})
        os.chmod(self.agent, 0o755)

    # ------------------------------------------------------------------ running
    def env(self, base: dict | None = None, thread_level: str | None = None,
            np: int | None = None) -> dict:
        """The launch environment: mpidist's (launcher.mpi_env) plus the MPI's wiring for
        the namespaces; real node detection (MPIDIST_RANKS_PER_NODE removed).
        thread_level: mpi4py's MPI_Init_thread level ("serialized" for one-sided windows
        across nodes), default mpi4py's own. np: the ranks started (default all). The nodes
        share this machine's cores, so threads per rank are set for all np ranks, not one
        node's (else a fused kernel's extra threads spin where another rank computes), and
        every rank counts np ranks on its cores (threads.ENV_MACHINE_RANKS: its waits nap
        where they outnumber the cores)."""
        env = mpi_env(self.size if np is None else int(np), base)
        env.pop("MPIDIST_RANKS_PER_NODE", None)
        env.update(self._remote()[1])
        env[ENV_NODE] = self.name
        env[threads.ENV_MACHINE_RANKS] = str(self.size if np is None else int(np))
        if thread_level is not None:
            if thread_level not in ("single", "funneled", "serialized", "multiple"):
                raise ValueError(f"thread_level must be single, funneled, serialized or "
                                 f"multiple, got {thread_level!r}")
            env["MPI4PY_RC_THREAD_LEVEL"] = thread_level
        return env

    def argv(self, command: list[str], np: int | None = None) -> list[str]:
        """The command line that runs `command` on the cluster's ranks (np: default all,
        block placement: ranks 0..L-1 on node 0, ...)."""
        np = self.size if np is None else int(np)
        if not 1 <= np <= self.size:
            raise ValueError(f"np must be in [1, {self.size}] on {self.nodes} x "
                             f"{self.ranks_per_node} ranks, got {np}")
        mpiexec = mpiexec_argv(np, command)
        at = mpiexec.index("-n")
        mpiexec[at:at] = self._remote()[0]
        return ["ip", "netns", "exec", self.node_ns[0], "unshare", "--uts", "sh", "-c",
                'hostname "$1"; shift; exec "$@"', "sim", self.node_ns[0], *mpiexec]

    def _remote(self) -> tuple[list[str], dict]:
        return remote_launch([(a, self.ranks_per_node) for a in self.addresses], self.agent,
                             NIC, SUBNET)

    def run(self, command: list[str], *, np: int | None = None, timeout: float | None = None,
            env: dict | None = None, thread_level: str | None = None,
            capture_output: bool = False, **kwargs):
        """Run `command` on the ranks and wait, like subprocess.run. After `timeout` seconds
        (or on an interrupt) every process in the cluster is killed and TimeoutExpired
        (or the interrupt) is raised."""
        if self.workdir is None:
            raise RuntimeError("the cluster is not started; use `with SimCluster(...)` or start()")
        if capture_output:
            kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
        with subprocess.Popen(self.argv(command, np), env=self.env(env, thread_level, np),
                              start_new_session=True,
                              **kwargs) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except BaseException:
                self._kill_processes()
                proc.kill()
                proc.communicate()
                raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def nic_counters(self) -> list[tuple[int, int]]:
        """(tx, rx) bytes of every node's NIC so far, read from outside the job."""
        out = []
        for ns in self.node_ns:
            base = ["ip", "netns", "exec", ns, "cat"]
            tx, rx = (int(_run(base + [f"/sys/class/net/{NIC}/statistics/{d}_bytes"]).stdout)
                      for d in ("tx", "rx"))
            out.append((tx, rx))
        return out

    def _kill_processes(self) -> None:
        for ns in self._made:
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass

    # ------------------------------------------------------------------ tear-down
    def close(self) -> None:
        """Kill what runs in the namespaces, delete them and the launcher files."""
        for ns in reversed(self._made):
            _kill_namespace(ns)
        self._made = []
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> "SimCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        """One line: nodes, ranks per node, link rate."""
        link = self.bandwidth or "unshaped"
        return (f"{self.nodes} node(s) x {self.ranks_per_node} rank(s), {link} links "
                f"through one switch (network namespaces {self.name}-*)")


def main(argv: list[str] | None = None) -> int:
    """`python -m mpidist.simcluster`: run a command on a simulated cluster; returns its exit code."""
    parser = argparse.ArgumentParser(prog="python -m mpidist.simcluster", description="Run a "
                                     "command on a simulated cluster of network namespaces (root).")
    parser.add_argument("--nodes", type=int, default=2, help="nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2)")
    parser.add_argument("--bandwidth", default="1gbit",
                        help="each node's link rate in tc syntax, or none (default 1gbit)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the job is killed")
    parser.add_argument("--thread-level", default=None,
                        choices=("single", "funneled", "serialized", "multiple"),
                        help="MPI thread level (serialized for one-sided windows across nodes)")
    parser.add_argument("--cleanup", action="store_true",
                        help="delete the namespaces of clusters whose owner died, then exit")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    args = parser.parse_args(argv)
    if args.cleanup:
        reason = unavailable_reason()
        if reason is not None:
            print(f"simcluster: {reason}", file=sys.stderr)
            return 2
        for ns in cleanup_stale():
            print(f"deleted {ns}")
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    try:
        cluster = SimCluster(args.nodes, args.ranks_per_node, args.bandwidth)
    except ValueError as exc:
        parser.error(str(exc))
    # SIGTERM (a batch system, `timeout`) unwinds like Ctrl-C, so the namespaces go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        with cluster:
            print(f"simcluster: {cluster.describe()}", file=sys.stderr, flush=True)
            return cluster.run(command, timeout=args.timeout,
                               thread_level=args.thread_level).returncode
    except RuntimeError as exc:
        print(f"simcluster: {exc}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired:
        print(f"simcluster: the job ran past --timeout {args.timeout:g} s and was killed",
              file=sys.stderr)
        return 124


if __name__ == "__main__":
    sys.exit(main())
