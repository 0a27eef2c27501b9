#!/usr/bin/env bash
# Stop the single-node SLURM started by slurm/start_local.sh (slurmd, slurmctld, munged).
set -uo pipefail
for f in /run/slurm/slurmd.pid /run/slurm/slurmctld.pid /run/munge/munged.pid; do
  if [ -s "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null; then
    kill "$(cat "$f")"
    for _ in $(seq 1 50); do kill -0 "$(cat "$f")" 2>/dev/null || break; sleep 0.2; done
  fi
done
echo "[slurm] stopped" >&2
