#!/usr/bin/env bash
# The whole test suite: plain pytest (one rank, plus the tests that start their own
# mpiexec), then under mpiexec at N = 2, 3, 4, and the communication core at N = 5; then the
# MPI-dependent tests again under MPICH (the PyPI wheels, a venv of its own) at N = 2, 3,
# and on a simulated cluster.
# Installs what it needs first (scripts/setup_env.sh; seconds when already set up).
# Each run has a wall-clock limit, and each test a timeout, so a deadlock fails, never hangs.
# Extra arguments go to every pytest run (e.g. -k allreduce, -x).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$here/scripts/setup_env.sh" | tail -n 1) || { echo "environment set-up failed" >&2; exit 1; }
# shellcheck disable=SC1091
source "$venv/bin/activate"
cd "$here"
# the FT environment (Open MPI 5 wheel with ULFM) for tests/ft, cached like the first one
if ft_venv=$(MPIDIST_MPI=ompi5-ft bash "$here/scripts/setup_env.sh" | tail -n 1); then
  export MPIDIST_FT_VENV=$ft_venv
else
  echo "[test] the FT environment did not build: tests/ft will skip" >&2
fi
# the second MPI (MPICH from PyPI), cached the same way, for its stage below and tests/test_quiet
if mpich_venv=$(MPIDIST_MPI=mpich bash "$here/scripts/setup_env.sh" | tail -n 1); then
  export MPIDIST_MPICH_VENV=$mpich_venv
else
  echo "[test] the MPICH environment did not build" >&2
fi
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-$HOME/.cache/mpidist/numba}
# the mismatch guard's compiled ballot, compiled once here so that the tests do not wait for
# it (its first compile takes seconds)
python -c 'from mpidist.collectives.ballot import compile_kernels; compile_kernels()' || echo "[test] the guard's ballot did not compile" >&2
out=$(mktemp -d /tmp/mpidist-tests.XXXXXX)
limit=${MPIDIST_TEST_RUN_LIMIT:-900}
status=0

# a thread asleep (state D) where the kernel takes the address space's lock (mmap, munmap,
# madvise) with no thread holding it: seen on Linux 6.18 when threads start or end beside the
# rank's own memory calls; or gdb held up reading that rank's memory map (the same lock:
# tests/native_stacks.py's GDB_STUCK). Not the suite's or MPI's deadlock, so the stage runs
# again (loudly, up to WEDGE_RERUNS times); a stage that fails otherwise fails.
KERNEL_WEDGE='^task .* state D wchan (vm_mmap_pgoff|__vm_munmap|madvise_do_behavior|do_madvise|__do_munmap)|^gdb did not finish in [0-9]+ s: the rank.s memory map did not answer'
WEDGE_RERUNS=2   # it met about one 4-rank run in three here: two reruns make a stage fail on it rarely

attempt() {  # attempt LABEL LOGDIR NRANKS PYTEST-ARGS...: one run of a stage; returns its status
  local label=$1 logdir=$2 n=$3; shift 3
  mkdir -p "$logdir"
  local cap=$limit; [ "$n" = plain ] && cap=$((limit * 2))   # the plain session runs every launcher test
  echo "=== $label: $n rank(s), limit ${cap}s ==="
  local start=$SECONDS
  if [ "$n" = plain ]; then
    MPIDIST_TEST_LOGDIR=$logdir timeout -k 20 "$cap" \
      python -m mpidist.launcher --env-only -- python -m pytest --junitxml="$out/$label.xml" "$@"
  else
    MPIDIST_TEST_LOGDIR=$logdir timeout -k 20 "$cap" \
      python -m mpidist.launcher -n "$n" -- python -m pytest --junitxml="$out/$label.xml" "$@"
  fi
  local rc=$?
  echo "=== $label: exit $rc in $((SECONDS - start)) s ==="
  if [ $rc -ne 0 ]; then
    [ $rc -eq 124 ] && echo "!!! $label hit the ${cap}s run limit (deadlock?)"
    for f in "$logdir"/rank*.log; do [ -s "$f" ] && { echo "--- $f (tail)"; tail -n 40 "$f"; }; done
    # a test that neared its timeout: where every rank's threads waited (tests/conftest.py)
    for f in "$logdir"/stacks-rank*.txt; do grep -q "most recent call first" "$f" 2>/dev/null && { echo "--- $f"; head -n 80 "$f"; }; done
    # and their native frames inside MPI and HDF5 (gdb, where it could attach)
    # (after the kernel's view: the host's load, and threads blocked in the kernel)
    for f in "$logdir"/native-rank*.txt; do [ -s "$f" ] && { echo "--- $f"
        grep -E "^(loadavg|pressure/memory)" "$f"; grep -A6 -E "^task .* state D" "$f" | head -n 30
        grep -E "^(rank|Thread)|ompi|opal|mca_|PMPI|pmix|H5|ptrace|did not (run|finish)" "$f" | head -n 60; }; done
  fi
  return $rc
}

wedged() {  # wedged LOGDIR: a rank's capture there shows the kernel wedge
  # grep reads the files itself: `cat | grep -q` fails under pipefail on a capture larger
  # than the pipe's buffer (grep stops at the first match, cat dies of SIGPIPE)
  grep -qE "$KERNEL_WEDGE" "$1"/native-rank*.txt 2>/dev/null
}

run() {  # run LABEL NRANKS PYTEST-ARGS...
  local label=$1 n=$2; shift 2
  local this=$label tries=0
  until attempt "$this" "$out/$this" "$n" "$@"; do
    if [ $tries -ge $WEDGE_RERUNS ] || ! wedged "$out/$this"; then
      status=1
      return
    fi
    tries=$((tries + 1))
    echo "!!! $this: a rank's thread is stuck in the kernel's address-space lock (above), not in"
    echo "!!! the suite or MPI; running $label again ($tries of at most $WEDGE_RERUNS)"
    [ -f "$out/$this.xml" ] && mv "$out/$this.xml" "$out/$this.xml.wedged"  # out of the totals
    this=$label.again$tries
  done
}

run n1 plain tests --durations=15 "$@"
for n in 2 3 4; do run "n$n" "$n" tests "$@"; done
run n5 5 tests/test_comm.py tests/collectives "$@"

# a second MPI: MPICH from PyPI, in its own cached venv (scripts/setup_env.sh MPIDIST_MPI=mpich),
# its own Numba cache (the ballot's kernels are compiled for MPICH's 32-bit handles); the
# collectives and the guard, the parameter server, checkpoints (the writer without MPI-IO),
# the engine, mpidist.torch and the torch backend; the main job through the launcher; the
# simulated cluster (Hydra's launch into the namespaces, TCP between them) and a plain
# mpiexec's binding
MPICH_TESTS=(tests/test_comm.py tests/test_mpilib.py tests/test_threads.py tests/collectives tests/ps
             tests/checkpoint tests/engine tests/torch tests/torch_backend)
if [ -n "${MPIDIST_MPICH_VENV:-}" ]; then
  (
    # shellcheck disable=SC1091
    source "$MPIDIST_MPICH_VENV/bin/activate"
    export NUMBA_CACHE_DIR=$NUMBA_CACHE_DIR-mpich
    python -c 'from mpidist.collectives.ballot import compile_kernels; compile_kernels()' \
      || echo "[test] the guard's ballot did not compile under MPICH" >&2
    for n in 2 3; do run "mpich/n$n" "$n" "${MPICH_TESTS[@]}" "$@"; done
    run mpich/job plain tests/engine/test_train_job.py -k main_job "$@"
    run mpich/plain plain tests/simcluster tests/test_threads.py -m launcher "$@"
    exit $status
  ) || status=1
else
  status=1
fi

python - "$out" <<'PY' || status=1
import glob, sys, xml.etree.ElementTree as ET
tot = dict(tests=0, failures=0, errors=0, skipped=0)
for f in sorted(glob.glob(sys.argv[1] + "/**/*.xml", recursive=True)):
    for s in ET.parse(f).getroot().iter("testsuite"):
        for k in tot:
            tot[k] += int(s.get(k, 0))
failed = tot["failures"] + tot["errors"]
passed = tot["tests"] - failed - tot["skipped"]
print(f"total: {passed} passed, {failed} failed, {tot['skipped']} skipped")
sys.exit(1 if failed or passed == 0 else 0)
PY

# the skips by reason; a component installed here whose tests skipped fails the run
installed=()
python -c 'import torch' 2>/dev/null && installed+=(torch)
python -c 'import jax' 2>/dev/null && installed+=(jax)
[ -n "${MPIDIST_FT_VENV:-}" ] && installed+=(ft)
python -c 'import sys; from mpidist.simcluster import unavailable_reason; sys.exit(unavailable_reason() is not None)' 2>/dev/null \
  && installed+=(netns)
python "$here/scripts/skip_report.py" "$out" --installed "$(IFS=,; echo "${installed[*]}")" || status=1
# the MPICH stage's venv has the torch extra only
if [ -d "$out/mpich" ]; then
  echo "--- the MPICH stage"
  mpich_installed=torch
  "$MPIDIST_MPICH_VENV/bin/python" -c 'import sys; from mpidist.simcluster import unavailable_reason; sys.exit(unavailable_reason() is not None)' 2>/dev/null \
    && mpich_installed+=,netns
  python "$here/scripts/skip_report.py" "$out/mpich" --installed "$mpich_installed" || status=1
fi
exit $status
