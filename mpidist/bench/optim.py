"""`mpidist bench optim`: the optimizer kernels against NumPy, STREAM triad and PyTorch.

    python -m mpidist.launcher -n 1 -- mpidist bench optim                  # 10M in 100 tensors
    python -m mpidist.launcher -n 1 -- mpidist bench optim --numel 1000000 --reps 5

What it measures, and how: main()'s docstring. See docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time

import numba
import numpy as np
from numba import njit, prange

from mpidist.comm import default_communicator
from mpidist.flat import Layout
from mpidist.launcher import mpi_env
from mpidist.optim import build_optimizer

__all__ = ["main", "bench_layout", "torch_optimizers", "BYTES"]

# bytes each step's kernel passes read + write per float32 element
BYTES = {
    "sgd": 20,     # update: read w, g, buf; write w, buf
    "adamw": 28,   # update: read w, g, m, v; write w, m, v
    "lars": 28,    # norms: read w, g (8); update as SGD (20)
    "lamb": 44,    # phase 1: read w, g, m, v (16); phase 2 as AdamW (28)
}
FINITE_BYTES = 4   # the local finite check reads g once (SGD, AdamW; LARS/LAMB get it free)
CONFIGS = [
    ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}),
    ("adamw", {"lr": 1e-3, "weight_decay": 1e-2}),
    ("lars", {"lr": 1.0, "momentum": 0.9, "weight_decay": 5e-4}),
    ("lamb", {"lr": 1e-3, "weight_decay": 1e-2}),
]


def bench_layout(numel: int, tensors: int = 100):
    """`tensors` tensors, numel elements in all: weights of varied sizes, each followed by a
    small bias (so the layer-wise exclusions are exercised)."""
    pairs = max(1, tensors // 2)
    rng = np.random.default_rng(0)
    w = rng.uniform(0.2, 1.8, pairs)
    bias = np.minimum(1024, np.maximum(1, numel // (pairs * 64)))
    weights = np.floor(w / w.sum() * (numel - bias * pairs)).astype(np.int64)
    weights[-1] += numel - bias * pairs - weights.sum()
    shapes = []
    for i, n in enumerate(weights):
        shapes += [(f"layer{i}.weight", (int(n),)), (f"layer{i}.bias", (int(bias),))]
    return Layout(shapes)


@njit(parallel=True, fastmath=False, cache=True)
def _triad(a, b, c, s):
    for i in prange(a.shape[0]):
        a[i] = b[i] + s * c[i]


def _time(fn, reps: int) -> tuple[float, float, float]:
    """(best, median) wall seconds of fn over reps runs, and the best process CPU seconds
    (all threads: on a machine shared with other work, CPU time / threads is the cleaner
    figure, since a preempted thread stalls the wall clock but not its CPU time)."""
    ts, cs = [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    return min(ts), float(np.median(ts)), min(cs)


# ---- float32 NumPy implementations of the four rules (the baseline to beat) ------------
def _numpy_step(name, h, layout, p, g, st, t, starts, sizes, decay):
    lr, wd = h["lr"], h["weight_decay"]
    wd_e = np.repeat(np.where(decay, wd, 0.0).astype(np.float32), sizes)
    if name == "sgd":
        d = g + wd_e * p
        st["buf"] *= h["momentum"]
        st["buf"] += d
        p -= np.float32(lr) * st["buf"]
    elif name == "adamw":
        b1, b2, eps = 0.9, 0.999, 1e-8
        p -= np.float32(lr) * wd_e * p
        st["m"] *= b1
        st["m"] += np.float32(1 - b1) * g
        st["v"] *= b2
        st["v"] += np.float32(1 - b2) * g * g
        denom = np.sqrt(st["v"]) / np.float32(np.sqrt(1 - b2 ** t)) + np.float32(eps)
        p -= np.float32(lr / (1 - b1 ** t)) * st["m"] / denom
    elif name == "lars":
        wn = np.sqrt(np.add.reduceat(p * p, starts))
        gn = np.sqrt(np.add.reduceat(g * g, starts))
        ok = (wn > 0) & (gn > 0) & decay
        trust = np.where(ok, 1e-3 * wn / np.where(ok, gn + wd * wn, 1), 1).astype(np.float32)
        d = g + wd_e * p
        st["buf"] *= h["momentum"]
        st["buf"] += np.float32(lr) * np.repeat(trust, sizes) * d
        p -= st["buf"]
    else:
        b1, b2, eps = 0.9, 0.999, 1e-6
        st["m"] *= b1
        st["m"] += np.float32(1 - b1) * g
        st["v"] *= b2
        st["v"] += np.float32(1 - b2) * g * g
        r = (st["m"] / np.float32(1 - b1 ** t)) / (np.sqrt(st["v"] / np.float32(1 - b2 ** t))
                                                    + np.float32(eps)) + wd_e * p
        wn = np.sqrt(np.add.reduceat(p * p, starts))
        rn = np.sqrt(np.add.reduceat(r * r, starts))
        ok = (wn > 0) & (rn > 0) & decay
        trust = np.where(ok, wn / np.where(ok, rn, 1), 1).astype(np.float32)
        p -= np.float32(lr) * np.repeat(trust, sizes) * r


def torch_optimizers(torch, params) -> list:
    """PyTorch's fastest AdamW and momentum SGD over params, with CONFIGS' hyperparameters:
    (label, the CONFIGS name it compares with, a function that builds it)."""
    return [("torch AdamW(fused=True)", "adamw",
             lambda: torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, fused=True)),
            ("torch SGD(momentum, foreach=True)", "sgd",
             lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4,
                                     foreach=True))]


def _torch_rows(layout, numel, reps):
    try:
        import torch                    # optional: the torch rows are skipped without it
    except ImportError:
        return {}
    torch.set_num_threads(int(os.environ.get("NUMBA_NUM_THREADS", os.cpu_count() or 1)))
    params = [torch.zeros(s.size, dtype=torch.float32).normal_() for s in layout]
    for q in params:
        q.grad = torch.randn_like(q)
    rows = {}
    for label, _, make in torch_optimizers(torch, params):
        try:
            opt = make()
            opt.step()
        except (RuntimeError, TypeError) as exc:        # e.g. fused CPU AdamW unavailable
            rows[label] = {"error": str(exc).splitlines()[0]}
            continue
        best, med, cpu = _time(opt.step, reps)
        rows[label] = {"best_ms": best * 1e3, "median_ms": med * 1e3, "cpu_ms": cpu * 1e3,
                       "torch": torch.__version__}
    return rows


_FIRST_CALL = """
import time, sys
t0 = time.perf_counter()
import numpy as np
from mpidist.flat import Layout
from mpidist.optim import build_optimizer
t1 = time.perf_counter()
layout = Layout([("fc.weight", (256, 256)), ("fc.bias", (256,))])
opt = build_optimizer(sys.argv[1], layout)
p = np.ones(layout.numel, np.float32)
c2, t2 = time.process_time(), time.perf_counter()
opt.step(p, p.copy())
print(t1 - t0, time.perf_counter() - t2, time.process_time() - c2)
"""


_FLOOR = """
import time
t0 = time.perf_counter()
import numpy as np
from mpidist.bench.optim import _triad
c1, t1 = time.process_time(), time.perf_counter()
a = np.ones(16, np.float32)
_triad(a, a.copy(), a.copy(), 1.0)
print(t1 - t0, time.perf_counter() - t1, time.process_time() - c1)
"""


def _first_call(name: str) -> dict:
    """Import and first-step seconds in a fresh process (run twice: the second has a warm
    Numba cache whatever the first found). name "floor": Numba's own floor, the first call
    of the cached triad kernel (numba import and target set-up, no optimizer)."""
    env = mpi_env(1)
    code, args = (_FLOOR, []) if name == "floor" else (_FIRST_CALL, [name])
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code, *args], env=env,
                             capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1]}
    imp, first, cpu = map(float, out.stdout.split())
    return {"import_s": imp, "first_step_s": first, "first_step_cpu_s": cpu}


def run(numel: int, tensors: int, reps: int, first_call: bool) -> dict:
    """Rank 0: every phase of the benchmark; returns the report as a dict."""

    layout = bench_layout(numel, tensors)
    rng = np.random.default_rng(1)
    g = rng.standard_normal(numel).astype(np.float32)
    p0 = rng.standard_normal(numel).astype(np.float32)
    res = {"numel": numel, "tensors": len(layout), "threads": numba.get_num_threads(),
           "reps": reps, "cpus": os.cpu_count(), "rows": {}}

    # 1. STREAM triad
    a, b, c = np.empty_like(p0), p0.copy(), g.copy()
    _triad(a, b, c, 3.0)
    best, med, cpu = _time(lambda: _triad(a, b, c, 3.0), reps)
    triad = 12 * numel / best / 1e9
    res["triad_GBps"] = triad
    res["rows"]["stream triad"] = {"best_ms": best * 1e3, "median_ms": med * 1e3,
                                   "cpu_ms": cpu * 1e3, "GBps": triad, "bytes": 12}
    del a, b, c

    # 2. the optimizers, Numba and NumPy
    starts = layout.bounds[:-1]
    sizes = np.diff(layout.bounds)
    for name, h in CONFIGS:
        opt = build_optimizer(name, layout, **h)
        decay = ~opt.excluded if name in ("lars", "lamb") else \
            np.ones(len(layout), bool)
        p = p0.copy()
        opt.step(p, g, finite=True)                       # cache load
        best, med, cpu = _time(lambda: opt.step(p, g, finite=True), reps)
        check = _time(lambda: opt.step(p, g), reps)[0]
        q = p0.copy()
        st = {k: np.zeros(numel, np.float32) for k in ("buf", "m", "v")}
        npb = _time(lambda: _numpy_step(name, h, layout, q, g, st, 2, starts, sizes, decay),
                    max(2, reps // 3))[0]
        gbps = BYTES[name] * numel / best / 1e9
        res["rows"][name] = {
            "best_ms": best * 1e3, "median_ms": med * 1e3, "cpu_ms": cpu * 1e3,
            "bytes": BYTES[name],
            "GBps": gbps, "of_triad": gbps / triad,
            "with_finite_check_ms": check * 1e3, "numpy_ms": npb * 1e3,
            "speedup_vs_numpy": npb / best}

    # 3. PyTorch, when installed
    res["rows"].update(_torch_rows(layout, numel, reps))

    # 4. first call in a new process
    if first_call:
        res["first_call"] = {name: _first_call(name) for name, _ in CONFIGS + [("floor", {})]}
    return res


def _print(res: dict) -> None:
    print(f"optimizer step over {res['numel']:,} float32 elements in {res['tensors']} tensors, "
          f"{res['threads']} Numba threads, best of {res['reps']}")
    print(f"{'kernel':34s} {'best ms':>9s} {'median':>9s} {'cpu ms':>8s} {'B/elem':>6s} {'GB/s':>7s} "
          f"{'%triad':>6s} {'+check':>8s} {'numpy ms':>9s} {'x numpy':>7s}")
    for label, r in res["rows"].items():
        if "error" in r:
            print(f"{label:34s} unavailable: {r['error']}")
            continue
        cols = [f"{r['best_ms']:9.2f}", f"{r['median_ms']:9.2f}", f"{r['cpu_ms']:8.2f}",
                f"{r.get('bytes', ''):>6}", f"{r['GBps']:7.2f}" if "GBps" in r else " " * 7,
                f"{100 * r['of_triad']:5.0f}%" if "of_triad" in r else " " * 6,
                f"{r['with_finite_check_ms']:8.2f}" if "with_finite_check_ms" in r else " " * 8,
                f"{r['numpy_ms']:9.2f}" if "numpy_ms" in r else " " * 9,
                f"{r['speedup_vs_numpy']:7.1f}" if "speedup_vs_numpy" in r else ""]
        print(f"{label:34s} " + " ".join(cols))
    for name, r in res.get("first_call", {}).items():
        if "error" in r:
            print(f"first call {name}: failed: {r['error']}")
        else:
            what = "numba floor (cached triad)" if name == "floor" else name
            print(f"first call {what:6s} in a new process (warm cache): import "
                  f"{r['import_s']:.2f} s, first step {r['first_step_s']:.3f} s "
                  f"({r['first_step_cpu_s']:.3f} s CPU)")


def _write(res: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "optim.json"), "w") as f:
        json.dump(res, f, indent=2)
    keys = sorted({k for r in res["rows"].values() for k in r})
    with open(os.path.join(out, "optim.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kernel"] + keys)
        for label, r in res["rows"].items():
            w.writerow([label] + [r.get(k, "") for k in keys])
    import matplotlib                  # slow to import, and only rank 0 plots
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n, _ in CONFIGS]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, [res["rows"][n]["GBps"] for n in names], color="tab:blue", label="Numba kernel")
    ax.axhline(res["triad_GBps"], color="k", ls="--", label="STREAM triad")
    ax.axhline(0.6 * res["triad_GBps"], color="tab:red", ls=":", label="60% of triad")
    ax.set_ylabel("GB/s (bytes the update moves)")
    ax.set_title(f"optimizer step, {res['numel'] / 1e6:.0f}M float32, {res['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "optim.png"), dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code.

    Phases (rank 0 alone; other ranks wait in a barrier):
      1. STREAM triad a = b + s*c in a parallel Numba kernel over numel float32 elements: the
         memory bandwidth the update kernels are held against (12 bytes per element counted,
         as STREAM counts them).
      2. each optimizer's step (Numba kernels, finite=True as a data-parallel caller passes it,
         and with the local finite check) against a float32 NumPy implementation of the same
         rule over the same flat buffer; bandwidth = bytes the kernel passes read and write per
         element (BYTES) * numel / time, and its share of the triad's.
      3. PyTorch's AdamW(fused=True) and SGD(momentum, foreach=True) on the same tensors, when
         torch imports.
      4. first step in a new process with a warm Numba cache, per optimizer (a subprocess,
         run twice so the second finds the cache warm): import time, first-step wall and CPU
         time (numba is imported by that first step), next to Numba's own floor: the first
         call of the cached triad kernel in a process that imported numba already.
    Writes optim.csv, optim.json and optim.png under --out (rank 0).
    """
    ap = argparse.ArgumentParser(prog="mpidist bench optim", description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=10_000_000, help="float32 parameters")
    ap.add_argument("--tensors", type=int, default=100, help="tensors in the layout")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions (best is reported)")
    ap.add_argument("--no-first-call", action="store_true",
                    help="skip the new-process first-call measurement")
    ap.add_argument("--out", default="results/bench/optim", help="output directory")
    args = ap.parse_args(argv)
    if args.numel < args.tensors or args.tensors < 2 or args.reps < 1:
        ap.error("need numel >= tensors >= 2 and reps >= 1")

    comm = default_communicator()
    if comm.rank == 0:
        res = run(args.numel, args.tensors, args.reps, not args.no_first_call)
        _print(res)
        _write(res, args.out)
        print(f"wrote {args.out}/optim.csv, optim.json, optim.png")
    comm.comm.Barrier()
    return 0
