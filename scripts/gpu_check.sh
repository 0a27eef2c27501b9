#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA GPU whose Python already has CuPy, Numba,
# mpi4py (with an MPI library and its mpiexec) and h5py: the gpu-marked tests at 1 and 2
# ranks (a node's GPUs round-robin by local rank), `mpidist bench gpu` (kernels at 1 rank,
# CuPy allreduce at 2), and the main job trained on the GPU at 2 ranks.
# Installs mpidist itself (editable, without dependencies) into that Python.
# Usage: bash scripts/gpu_check.sh [OUTDIR]     (OUTDIR gets the bench JSON and job metrics)
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$here/results/gpu_check}
py=$(command -v "${PYTHON:-python3}") || { echo "no python3" >&2; exit 1; }
mkdir -p "$out"
cd "$here"
status=0
step() {  # step LABEL LIMIT COMMAND...
  local label=$1 limit=$2; shift 2
  echo "=== $label ==="
  local start=$SECONDS
  timeout -k 10 "$limit" "$@"
  local rc=$?
  echo "=== $label: exit $rc in $((SECONDS - start)) s ==="
  [ $rc -eq 0 ] || status=1
}
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/mpidist-numba}
"$py" -m pip install -q --no-deps --no-build-isolation -e . || exit 1
"$py" -m mpidist info 2>&1 | head -20
step "gpu tests, 1 rank" 240 "$py" -m mpidist.launcher --env-only -- \
  "$py" -m pytest -q -m gpu -p no:cacheprovider tests
step "gpu tests, 2 ranks" 240 "$py" -m mpidist.launcher -n 2 -- \
  "$py" -m pytest -q -m gpu -p no:cacheprovider tests/collectives tests/engine tests/ps \
  tests/torch tests/test_comm.py
step "bench gpu, kernels" 180 "$py" -m mpidist.launcher -n 1 -- \
  "$py" -m mpidist bench gpu --only bandwidth,optim,compress --out "$out/kernels"
step "bench gpu, allreduce at 2 ranks" 120 "$py" -m mpidist.launcher -n 2 -- \
  "$py" -m mpidist bench gpu --only allreduce --reps 20 --out "$out/allreduce"
step "main job on the GPU, 2 ranks" 180 "$py" -m mpidist.launcher -n 2 -- \
  "$py" -m mpidist train jobs/digits_lamb.toml --set job.device=gpu \
  --set job.out_dir="$out/train"
exit $status
