#!/usr/bin/env bash
# Stop the single-node SLURM started by slurm/start_local.sh (slurmd, slurmctld, munged).
set -uo pipefail
for f in /run/slurm/slurmd.pid /run/slurm/slurmctld.pid /run/munge/munged.pid; do
  [ -s "$f" ] || continue
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  fi
done
echo "[slurm] stopped" >&2
