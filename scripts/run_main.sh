#!/usr/bin/env bash
# The main job: installs what it needs (seconds when already set up), then trains the MLP on
# the bundled handwritten-digits data on 4 ranks: data parallel, ring allreduce, LAMB.
# Extra arguments go to `mpidist train` (e.g. --resume, --out runs/x). MPIDIST_NP sets ranks.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$here/scripts/setup_env.sh" | tail -n 1)
# shellcheck disable=SC1091
source "$venv/bin/activate"
cd "$here"
exec python -m mpidist.launcher -n "${MPIDIST_NP:-4}" -- mpidist train jobs/digits_lamb.toml "$@"
