#!/usr/bin/env bash
# Run a command on a simulated multi-node cluster: network namespaces joined by a bridge,
# per-link bandwidth shaped with tc tbf, ranks started by Open MPI (TCP between nodes,
# shared memory within). Needs root and iproute2; tears everything down on exit.
#   scripts/sim_cluster.sh --nodes 2 --ranks-per-node 2 --bandwidth 1gbit -- mpidist info
#   scripts/sim_cluster.sh --cleanup          (namespaces left by a killed run)
# Options: python -m mpidist.simcluster --help
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$here/scripts/setup_env.sh" | tail -n 1) || { echo "environment set-up failed" >&2; exit 1; }
# shellcheck disable=SC1091
source "$venv/bin/activate"
cd "$here"
exec python -m mpidist.simcluster "$@"
