"""algorithm="auto": the cheapest algorithm by the cost model, checked on-line by the first
calls of each size (autotune), and `explain`, which prints the model's prediction beside a
measurement for every algorithm.

    python -m mpidist.launcher -n 4 -- mpidist explain --sizes 4K,64K,1M,64M
    mpiexec -n 4 mpidist explain --refit
"""
from __future__ import annotations

import argparse

import numpy as np

from mpidist.collectives import autotune, costmodel
from mpidist.comm import Communicator, as_communicator, mpi_library

__all__ = ["choose", "explain", "main", "parse_size", "parse_sizes"]


def choose(comm, nbytes: int, x=None, op=None) -> str:
    """The algorithm "auto" runs for nbytes on comm; the same on every rank. Collective the
    first time a communicator asks (the model is loaded or probed) and at the first size
    of each class (the trials time the model's shortlist on x, or on ones of nbytes, with
    op: autotune); then a lookup in comm.auto_picks, a fraction of a microsecond."""
    return comm.auto_picks.get(nbytes) or \
        autotune.tuner(comm).choose(nbytes, lambda: _trial(comm, nbytes, x, op))


def _trial(comm, nbytes: int, x, op):
    """auto's trial function on x (or on ones of nbytes), cut to autotune.TRIAL_BYTES."""
    from mpidist.collectives.core import trial_runner
    from mpidist.collectives.ops import get_op
    if x is None:
        x = np.ones(max(1, min(nbytes, autotune.TRIAL_BYTES) // 4), np.float32)
    x = x[:max(1, autotune.TRIAL_BYTES // max(4, x.itemsize))]
    return trial_runner(comm, x, get_op("sum" if op is None else op))


def explain(sizes, comm=None, *, reps: int = 3, refit: bool = False) -> list[dict]:
    """Collective: for every size and algorithm, predicted and measured seconds, the
    model's choice and auto's pick after its trials. Rows: {"nbytes", "algorithm",
    "predicted", "measured", "chosen" (by the model), "picked" (by auto)}."""
    c = as_communicator(comm)
    model = costmodel.get_model(c, refit=refit)
    rows = []
    for nbytes in sizes:
        pick, picked = model.choose(nbytes), choose(c, nbytes)
        names = model.candidates() if c.size > 1 else ["native"]
        measured = costmodel.measure_all(c, names, nbytes, reps)
        rows.extend({"nbytes": int(nbytes), "algorithm": alg,
                     "predicted": model.predict(alg, nbytes), "measured": measured[alg],
                     "chosen": alg == pick, "picked": alg == picked} for alg in names)
    return rows


def parse_size(text: str) -> int:
    """'64K' -> 65536, '1M', '2G', '512' (bytes)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512, 64K, 1M)") from None


def parse_sizes(text: str) -> list[int]:
    """'4K,1M,64M' -> bytes (an argparse type: a bad entry is a clean usage error)."""
    return [parse_size(s) for s in text.split(",") if s.strip()]


def format_size(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def main(argv: list[str] | None = None) -> int:
    """`mpidist explain`: the cost model's choice per size, predicted vs measured."""
    ap = argparse.ArgumentParser(prog="mpidist explain", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4K,64K,1M,16M",
                    type=parse_sizes,
                    help="message sizes in bytes, comma separated (default 4K,64K,1M,16M)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per point")
    ap.add_argument("--refit", action="store_true", help="probe again, ignoring the cache")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="simulate nodes of this many ranks (default: real topology)")
    args = ap.parse_args(argv)
    c = Communicator(ranks_per_node=args.ranks_per_node)
    rows = explain(args.sizes, c, reps=args.reps, refit=args.refit)
    path = costmodel.cache_path(c)                       # collective
    if c.rank == 0:
        model = costmodel.get_model(c)
        print(f"# {mpi_library()}; {c.describe()}")
        print(f"# cost model: {path}")
        for name, lv in model.levels.items():
            fits = ", ".join(f"{a} a={v[0] * 1e6:.1f}us b={v[1] * 1e9:.3f}ns/B"
                             for a, v in lv["fits"].items())
            note = " (over all sizes; predictions use per-range pieces)" if lv.get("pieces") \
                else ""
            print(f"# level {name}: p={lv['p']} gamma={lv['gamma'] * 1e9:.3f}ns/B; {fits}{note}")
            cond = lv.get("conditions")
            if cond:
                print(f"#   probed {cond['when']} in {cond['seconds']:.1f} s, load average "
                      f"{cond['load_before']:.1f} -> {cond['load_after']:.1f} on "
                      f"{cond['cores']} cores, sizes {format_size(cond['sizes'][0])}.."
                      f"{format_size(cond['sizes'][-1])}")
        print(f"{'size':>8} {'algorithm':>19} {'predicted ms':>13} {'measured ms':>12} "
              f"{'error':>7}  choice (model: the prediction's; auto: after its trials)")
        for r in rows:
            err = (r["predicted"] - r["measured"]) / r["measured"] if r["measured"] else 0.0
            marks = ", ".join(w for w, on in (("model", r["chosen"]), ("auto", r["picked"])) if on)
            print(f"{format_size(r['nbytes']):>8} {r['algorithm']:>19} "
                  f"{r['predicted'] * 1e3:13.3f} {r['measured'] * 1e3:12.3f} {err:+7.0%}  "
                  f"{'<- ' + marks if marks else ''}")
    c.free()
    return 0
