"""`mpidist explain`: per size, the cost model's prediction, the decision table's (or the
built-in rule's) choice and a measurement of every algorithm, side by side.

    python -m mpidist.launcher -n 4 -- mpidist explain --sizes 4K,64K,1M,64M
    MPIDIST_ALGORITHM_TABLE=table.json mpiexec -n 4 mpidist explain --table table.json

See docs/ARCHITECTURE.md (collectives).
"""
from __future__ import annotations

import argparse

from mpidist.collectives import select
from mpidist.collectives.tuning import costmodel, timing
from mpidist.comm import Communicator, as_communicator, mpi_library
from mpidist.sizes import format_size, parse_sizes

__all__ = ["explain", "main"]


def explain(sizes, comm=None, *, reps: int = 3, refit: bool = False) -> list[dict]:
    """Collective: for every size and algorithm, predicted and measured seconds, whether
    the model chose it and whether auto (select.choose) runs it. Rows: {"nbytes",
    "algorithm", "predicted", "measured", "chosen" (by the model), "picked" (by auto)}."""
    c = as_communicator(comm)
    model = costmodel.get_model(c, refit=refit)
    rows = []
    for nbytes in sizes:
        pick, picked = model.choose(nbytes), select.choose(c, nbytes)
        modelled = model.candidates() if c.size > 1 else ["native"]
        names = modelled + ([picked] if picked not in modelled else [])
        measured = timing.measure_all(c, names, nbytes, reps)
        rows.extend({"nbytes": int(nbytes), "algorithm": alg,
                     "predicted": model.predict(alg, nbytes) if alg in modelled else None,
                     "measured": measured[alg],
                     "chosen": alg == pick, "picked": alg == picked} for alg in names)
    return rows


def main(argv: list[str] | None = None) -> int:
    """`mpidist explain`: model, table (or rule) and measurement per size and algorithm."""
    ap = argparse.ArgumentParser(prog="mpidist explain", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4K,64K,1M,16M", type=parse_sizes,
                    help="message sizes in bytes, comma separated (default 4K,64K,1M,16M)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per point")
    ap.add_argument("--refit", action="store_true", help="probe again, ignoring the cache")
    ap.add_argument("--table", default=None,
                    help="the decision table to explain (default: env MPIDIST_ALGORITHM_TABLE)")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="simulate nodes of this many ranks (default: real topology)")
    args = ap.parse_args(argv)
    if args.table:
        select.use_table(args.table)
    c = Communicator(ranks_per_node=args.ranks_per_node)
    rows = explain(args.sizes, c, reps=args.reps, refit=args.refit)
    path = costmodel.cache_path(c)                       # collective
    if c.rank == 0:
        model = costmodel.get_model(c)
        print(f"# {mpi_library()}; {c.describe()}")
        print(f"# auto: {select.describe(c)}")
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
              f"{'error':>7}  choice (model: the prediction's; auto: the table's or rule's)")
        for r in rows:
            pred = r["predicted"]
            err = f"{(pred - r['measured']) / r['measured']:+7.0%}" \
                if pred is not None and r["measured"] else f"{'-':>7}"
            marks = ", ".join(w for w, on in (("model", r["chosen"]), ("auto", r["picked"])) if on)
            shown = f"{pred * 1e3:13.3f}" if pred is not None else f"{'-':>13}"
            print(f"{format_size(r['nbytes']):>8} {r['algorithm']:>19} "
                  f"{shown} {r['measured'] * 1e3:12.3f} {err}  "
                  f"{'<- ' + marks if marks else ''}")
    c.free()
    return 0
