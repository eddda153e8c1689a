#!/usr/bin/env bash
# One node's share of a foundryx job: starts `foundryx launch` (Composer's launcher; Slurm's
# SIGTERM or SIGUSR1 is passed on to the ranks, which save, and it exits 75 when they did),
# which starts one training process per GPU. srun runs this once per node (see slurm.sbatch);
# it also runs by hand, e.g.
#   SLURM_NNODES=2 SLURM_NODEID=1 MASTER_ADDR=10.0.0.1 NPROC_PER_NODE=8 \
#     launch/slurm_node.sh train.py yamls/mpt-1b.yaml
#
# Reads: SLURM_NNODES, SLURM_NODEID (set by Slurm), MASTER_ADDR (required), MASTER_PORT
# (default 29500), NPROC_PER_NODE (default: SLURM_GPUS_ON_NODE, else 1).
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
: "${SLURM_NNODES:?not under Slurm: set SLURM_NNODES and SLURM_NODEID}"
NPROC=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
exec foundryx launch \
  --world_size $((SLURM_NNODES * NPROC)) \
  --node_rank "${SLURM_NODEID:?}" \
  --master_addr "$MASTER_ADDR" \
  --master_port "${MASTER_PORT:-29500}" \
  -n "$NPROC" \
  "$@"
