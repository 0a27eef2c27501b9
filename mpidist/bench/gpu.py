"""`mpidist bench gpu`: the GPU paths on a CUDA device: optimizer kernels, compressor
kernels and the allreduce of CuPy buffers.

    mpidist bench gpu                                       # one rank, 64M float32
    python -m mpidist.launcher -n 2 -- mpidist bench gpu --only allreduce

What it measures, and how: main()'s docstring. See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import numpy as np

from mpidist.bench import compress as compress_bench
from mpidist.bench import optim as optim_bench
from mpidist.collectives import allreduce
from mpidist.comm import Communicator, mpi_library
from mpidist.compress import make_compressor
from mpidist.kernels.backend import gpu_available
from mpidist.optim import build_optimizer
from mpidist.sizes import parse_sizes

__all__ = ["main"]

PHASES = ("bandwidth", "optim", "compress", "allreduce")
ALLREDUCE_SIZES = "4K,256K,4M,64M"
ALLREDUCE_ALGORITHMS = "native,ring,tree,rabenseifner"


def _timed(cp, fn, reps: int) -> float:
    """Best wall seconds of fn between stream synchronisations (one untimed warm-up)."""
    fn()
    cp.cuda.get_current_stream().synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        cp.cuda.get_current_stream().synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _torch_cuda():
    """torch, when it imports and sees a GPU; else None."""
    try:
        import torch                    # optional: the torch rows are skipped without it
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def bandwidth(cp, numel: int, reps: int) -> dict:
    """Phase 1: the device's triad and copy bandwidth, GB/s."""
    triad = cp.ElementwiseKernel("float32 b, float32 c, float32 s", "float32 a",
                                 "a = b + s * c", "mpidist_triad")
    b = cp.random.standard_normal(numel, dtype=cp.float32)
    c = cp.random.standard_normal(numel, dtype=cp.float32)
    a = cp.empty_like(b)
    t_triad = _timed(cp, lambda: triad(b, c, np.float32(3.0), a), reps)
    t_copy = _timed(cp, lambda: cp.copyto(a, b), reps)
    return {"triad_ms": t_triad * 1e3, "triad_GBps": 12 * numel / t_triad / 1e9,
            "copy_ms": t_copy * 1e3, "copy_GBps": 8 * numel / t_copy / 1e9}


def optimizers(cp, numel: int, tensors: int, reps: int, triad_GBps: float | None) -> dict:
    """Phase 2: each optimizer's step with the CuPy and the numba.cuda kernels (and torch's)."""
    layout = optim_bench.bench_layout(numel, tensors)
    g = cp.random.standard_normal(numel, dtype=cp.float32)
    p0 = cp.random.standard_normal(numel, dtype=cp.float32)
    rows = {}
    for backend in ("cupy", "numba-cuda"):
        for name, h in optim_bench.CONFIGS:
            opt = build_optimizer(name, layout, backend=backend, **h)
            p = p0.copy()
            t = _timed(cp, lambda: opt.step(p, g, finite=True), reps)
            gbps = optim_bench.BYTES[name] * numel / t / 1e9
            rows[f"{name} ({backend})"] = {
                "ms": t * 1e3, "bytes": optim_bench.BYTES[name], "GBps": gbps,
                "of_triad": gbps / triad_GBps if triad_GBps else None}
    torch = _torch_cuda()
    if torch is not None:
        params = [torch.randn(s.size, device="cuda") for s in layout]
        for q in params:
            q.grad = torch.randn_like(q)
        for label, name, make in optim_bench.torch_optimizers(torch, params):
            opt = make()
            t = _timed(cp, lambda: (opt.step(), torch.cuda.synchronize()), reps)
            nbytes = optim_bench.BYTES[name]
            rows[label] = {"ms": t * 1e3, "bytes": nbytes, "GBps": nbytes * numel / t / 1e9,
                           "torch": torch.__version__}
    return {"numel": numel, "tensors": len(layout), "rows": rows}


def compressors(cp, numel: int, reps: int) -> dict:
    """Phase 3: each compressor's encode on a CuPy gradient, GB/s of float32 input."""
    layout = compress_bench.bench_layout(numel)
    x = cp.random.standard_normal(layout.numel, dtype=cp.float32)
    gb = x.nbytes / 1e9
    rows = {}
    for label, name, opts in compress_bench.CONFIGS:
        c = make_compressor(name, **opts)
        payload, _ = c.compress(x, layout)           # kernel compilation, warm starts
        t = _timed(cp, lambda: c.encode(x, layout), reps)
        rows[label] = {"encode_ms": t * 1e3, "encode_GBps": gb / t,
                       "payload_ratio": c.payload_nbytes(payload) / x.nbytes}
    rows["cupy astype(float16)"] = {"encode_GBps": gb / _timed(cp, lambda: x.astype(cp.float16),
                                                               reps)}
    torch = _torch_cuda()
    if torch is not None:
        xt = torch.as_tensor(x, device="cuda")
        k = max(1, x.size // 100)
        rows["torch.topk 1%"] = {"encode_GBps": gb / _timed(
            cp, lambda: (torch.topk(xt.abs(), k), torch.cuda.synchronize()), reps)}
    return {"numel": layout.numel, "rows": rows}


def allreduces(cp, comm, sizes: list[int], algorithms: list[str], reps: int) -> dict:
    """Phase 4 (collective): each algorithm on CuPy and NumPy buffers of each size."""
    rows = {}
    for nbytes in sizes:
        n = nbytes // 4
        for algorithm in algorithms:
            row = {}
            for kind, xp in (("cupy", cp), ("numpy", np)):
                x = xp.ones(n, xp.float32)
                allreduce(x, algorithm=algorithm, comm=comm)
                times = []
                for _ in range(reps):
                    x.fill(1)                  # the same input every call, untimed
                    if xp is cp:
                        cp.cuda.get_current_stream().synchronize()
                    comm.comm.Barrier()
                    t0 = time.perf_counter()
                    allreduce(x, algorithm=algorithm, comm=comm)
                    if xp is cp:
                        cp.cuda.get_current_stream().synchronize()
                    times.append(time.perf_counter() - t0)
                ok = bool(float(x[0]) == comm.size and float(x[-1]) == comm.size)
                row[f"{kind}_us"] = max(comm.comm.allgather(float(np.median(times)))) * 1e6
                row[f"{kind}_ok"] = all(comm.comm.allgather(ok))
            row["staging_x"] = row["cupy_us"] / row["numpy_us"]
            rows[f"{nbytes} {algorithm}"] = {"bytes": nbytes, "algorithm": algorithm, **row}
    return {"ranks": comm.size, "cuda_aware": comm.cuda_aware, "rows": rows}


def _print(report: dict) -> None:
    print(f"GPU: {report['device']}, CuPy {report['cupy']}, MPI: {report['mpi']}, "
          f"{report['ranks']} rank(s)")
    bw = report.get("bandwidth")
    if bw and "error" not in bw:
        print(f"device bandwidth: triad {bw['triad_GBps']:.0f} GB/s ({bw['triad_ms']:.3f} ms), "
              f"copy {bw['copy_GBps']:.0f} GB/s")
    op = report.get("optim")
    if op and "error" not in op:
        print(f"\noptimizer step, {op['numel']:,} float32 in {op['tensors']} tensors")
        print(f"{'kernel':36s} {'ms':>8s} {'B/elem':>6s} {'GB/s':>7s} {'%triad':>6s}")
        for label, r in op["rows"].items():
            share = f"{100 * r['of_triad']:5.0f}%" if r.get("of_triad") else ""
            print(f"{label:36s} {r['ms']:8.3f} {r['bytes']:6d} {r['GBps']:7.0f} {share:>6s}")
    cr = report.get("compress")
    if cr and "error" not in cr:
        print(f"\ncompressor encode, {cr['numel']:,} float32")
        print(f"{'compressor':28s} {'GB/s':>8s} {'payload':>8s}")
        for label, r in cr["rows"].items():
            ratio = f"{r['payload_ratio']:8.4f}" if "payload_ratio" in r else ""
            print(f"{label:28s} {r['encode_GBps']:8.1f} {ratio}")
    ar = report.get("allreduce")
    if ar and "error" not in ar:
        print(f"\nallreduce, {ar['ranks']} rank(s), CUDA-aware MPI: {ar['cuda_aware']} "
              "(median us, slowest rank)")
        print(f"{'bytes':>10s} {'algorithm':14s} {'cupy us':>10s} {'numpy us':>10s} "
              f"{'cupy/numpy':>10s} {'ok':>3s}")
        for r in ar["rows"].values():
            ok = "yes" if r["cupy_ok"] and r["numpy_ok"] else "NO"
            print(f"{r['bytes']:10d} {r['algorithm']:14s} {r['cupy_us']:10.1f} "
                  f"{r['numpy_us']:10.1f} {r['staging_x']:10.2f} {ok:>3s}")
    for phase in PHASES:
        if "error" in report.get(phase, {}):
            print(f"\n{phase}: FAILED\n{report[phase]['error']}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code.

    Phases (each timed between stream synchronisations, best of --reps; a phase that fails
    prints its error and the others still run):
      1. device bandwidth: a CuPy triad a = b + s*c (12 bytes per element, as STREAM counts)
         and a device-to-device copy (8 bytes per element); rank 0.
      2. optimizers: each rule's step with the CuPy kernels and the numba.cuda kernels on
         CuPy arrays (finite=True, as a data-parallel caller passes it), as GB/s of the bytes
         the step moves (bench.optim.BYTES) and its share of the triad's; PyTorch's
         AdamW(fused=True) and SGD(foreach=True) on the same tensors when torch sees the GPU.
      3. compressors: each compressor's encode on a CuPy gradient, as GB/s of float32 input,
         next to CuPy's astype(float16) and torch.topk (1%) where torch is there; rank 0.
      4. allreduce: every rank (on its node's GPUs round-robin by local rank) reduces a CuPy
         buffer and a NumPy buffer of the same size with each algorithm: median seconds, slowest
         rank (ranks sharing one GPU also share its time slices). A CuPy buffer goes straight
         to a CUDA-aware MPI, else through host memory; the gap between the columns is that.
    Writes gpu.json under --out (rank 0).
    """
    ap = argparse.ArgumentParser(prog="mpidist bench gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=64 * 2**20,
                    help="float32 elements of the optimizer and compressor phases (64M)")
    ap.add_argument("--tensors", type=int, default=100, help="tensors in the optimizer layout")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions")
    ap.add_argument("--only", default=",".join(PHASES), help="phases to run (comma-separated)")
    ap.add_argument("--sizes", default=ALLREDUCE_SIZES, type=parse_sizes,
                    help="allreduce message sizes in bytes (K/M/G suffixes)")
    ap.add_argument("--algorithms", default=ALLREDUCE_ALGORITHMS, help="allreduce algorithms")
    ap.add_argument("--out", default=os.path.join("results", "bench", "gpu"))
    args = ap.parse_args(argv)
    phases = [p for p in args.only.split(",") if p]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown or args.numel < args.tensors or args.tensors < 2 or args.reps < 1:
        ap.error(f"--only takes {', '.join(PHASES)}; need numel >= tensors >= 2, reps >= 1"
                 + (f" (unknown: {', '.join(unknown)})" if unknown else ""))

    comm = Communicator()
    if not all(comm.comm.allgather(gpu_available())):
        if comm.rank == 0:
            print("mpidist bench gpu: needs CuPy and a CUDA GPU on every rank")
        comm.free()
        return 2
    import cupy as cp                   # optional: checked by gpu_available above
    props = cp.cuda.runtime.getDeviceProperties(comm.use_gpu())
    report = {"device": props["name"].decode(), "cupy": cp.__version__, "mpi": mpi_library(),
              "ranks": comm.size}

    def phase(name, fn):
        try:
            report[name] = fn()
        except Exception:                               # a bench reports, and goes on
            report[name] = {"error": traceback.format_exc(limit=6)}

    if comm.rank == 0:
        if "bandwidth" in phases:
            phase("bandwidth", lambda: bandwidth(cp, args.numel, args.reps))
        triad = report.get("bandwidth", {}).get("triad_GBps")
        if "optim" in phases:
            phase("optim", lambda: optimizers(cp, args.numel, args.tensors, args.reps, triad))
        if "compress" in phases:
            phase("compress", lambda: compressors(cp, args.numel, args.reps))
    if "allreduce" in phases:
        phase("allreduce", lambda: allreduces(cp, comm, args.sizes, args.algorithms.split(","),
                                              args.reps))
    if comm.rank == 0:
        _print(report)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu.json"), "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}/gpu.json")
    comm.free()
    return 0 if not any("error" in report.get(p, {}) for p in phases) else 1
