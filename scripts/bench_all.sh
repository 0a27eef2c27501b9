#!/usr/bin/env bash
# Every benchmark behind the issues' targets, one after the other (run it on a quiet machine:
# the figures are timings). Output: results/bench/<name>/ plus a log per benchmark in
# results/bench/logs/. Set TORCH_SITE to a site-packages holding torch to add the PyTorch
# comparisons (optim, train); without it they say torch is missing.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$here/scripts/setup_env.sh" | tail -n 1)
# shellcheck disable=SC1091
source "$venv/bin/activate"
cd "$here"
logs=results/bench/logs; mkdir -p "$logs"
[ -n "${TORCH_SITE:-}" ] && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$TORCH_SITE"
bench() {  # bench NAME LOGNAME RANKS ARGS...
  local name=$1 log=$2 n=$3; shift 3
  echo "=== mpidist bench $name (-n $n) $*"
  local how=(-n "$n"); [ "$n" = self ] && how=(--env-only)   # 'self': it starts its own ranks
  timeout -k 10 1200 python -m mpidist.launcher "${how[@]}" -- mpidist bench "$name" "$@" 2>&1 | tee "$logs/$log.log"
}
bench allreduce allreduce_4 4 --out results/bench/allreduce_4
bench allreduce allreduce_2 2 --out results/bench/allreduce_2
NUMBA_NUM_THREADS=1 bench optim optim_1thread 1
bench optim optim 1
bench compress compress_4 4
bench compress compress_2 2
bench train train self
bench zero zero 4
bench pipeline pipeline 4
bench ps ps 4
bench checkpoint checkpoint 4
