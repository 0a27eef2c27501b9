# Sourced by the slurm/*.sbatch scripts: enter the repository, activate its environment and
# hand SLURM's layout to mpidist (MPIDIST_RANKS_PER_NODE from the tasks per node, which the
# hierarchical allreduce uses). Submit from the repository root, or set MPIDIST_ROOT.
root=${MPIDIST_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
if [ ! -f "$root/scripts/setup_env.sh" ]; then
  echo "[mpidist] $root is not the mpidist repository: submit from its root or set MPIDIST_ROOT" >&2
  exit 2
fi
cd "$root" || exit 2
venv=$(bash scripts/setup_env.sh | tail -n 1) || exit 1
# shellcheck disable=SC1091
source "$venv/bin/activate"

# ranks per node: --ntasks-per-node, else SLURM_TASKS_PER_NODE when uniform ("4" or "4(x2)")
tpn=${SLURM_NTASKS_PER_NODE:-}
if [ -z "$tpn" ] && [[ ${SLURM_TASKS_PER_NODE:-} =~ ^([0-9]+)(\(x[0-9]+\))?$ ]]; then
  tpn=${BASH_REMATCH[1]}
fi
if [ -n "$tpn" ]; then
  export MPIDIST_RANKS_PER_NODE=$tpn
fi
if [ "$(id -u)" -eq 0 ]; then      # containers: Open MPI refuses root unless told
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# single copy between ranks (CMA) stays on unless this machine forbids it (mpidist.launcher)
if ! python -c 'import sys; from mpidist.launcher import cma_permitted; sys.exit(not cma_permitted())'; then
  export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
else  # osc/rdma over vader+CMA crashes in MPI_Compare_and_swap (Open MPI 4.x, ompi#7967)
  export OMPI_MCA_osc=${OMPI_MCA_osc:-^rdma}
fi
export PYTHONUNBUFFERED=1
echo "[mpidist] job ${SLURM_JOB_ID:-?}${SLURM_ARRAY_TASK_ID:+ task $SLURM_ARRAY_TASK_ID} on $(hostname):" \
     "${SLURM_NTASKS:-?} tasks on ${SLURM_JOB_NUM_NODES:-1} node(s), ranks per node" \
     "${MPIDIST_RANKS_PER_NODE:-auto}, restart ${SLURM_RESTART_COUNT:-0}"
