#!/bin/bash
# One torchrun per node of a SLURM allocation, joined by a c10d rendezvous on the first node: the body of
# the sbatch scripts beside this file. Usage (inside an allocation, from the repository root):
#   bash scripts/slurm/launch.sh RECIPE [train_disagg.py flags...]
# Environment: PYTHON (default .venv/bin/python), GPUS_PER_NODE (default 8), RDZV_PORT (default 29500),
# TOPOLOGY (default recipes/topology/<nodes x GPUS_PER_NODE>gpus.toml when it exists; "none" for the
# recipe's own). The repository, the weights, the prompt files and the output folder must be on a
# filesystem every node sees (README, "Multi-node").
set -euo pipefail

recipe=${1:?usage: launch.sh RECIPE [flags...]}
shift
python=${PYTHON:-.venv/bin/python}
gpus_per_node=${GPUS_PER_NODE:-8}
nodes=${SLURM_JOB_NUM_NODES:?run inside a SLURM allocation (sbatch scripts/slurm/*.sbatch)}
mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")  # no pipe into head: SIGPIPE under pipefail
head_node=${hosts[0]:?no host in SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST}
topology=${TOPOLOGY:-recipes/topology/$((nodes * gpus_per_node))gpus.toml}
configs=(--config "$recipe")
if [ "$topology" != none ] && [ -f "$topology" ]; then
    configs+=(--config "$topology")
fi

# NCCL (README, "The first NCCL run"): a failed or timed-out operation ends its process (never 0: a rank
# would wait in a dead collective), NCCL's errors in the log, the pending operations dumped on a timeout.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
# Uncomment what the cluster needs. Name the InfiniBand adapters and the interface of the bootstrap
# network if NCCL picks the wrong ones; NCCL_DEBUG=INFO prints the chosen transports once.
# export NCCL_IB_HCA=mlx5
# export NCCL_SOCKET_IFNAME=ib0          # or the Ethernet interface that reaches the other nodes
# export NCCL_IB_DISABLE=0               # 1 only on clusters without InfiniBand (RoCE/TCP instead)
# export NCCL_NET_GDR_LEVEL=PHB          # GPUDirect RDMA where the NICs and GPUs share a PCIe switch
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export HF_HUB_OFFLINE=1                  # weights come from local folders only

echo "$(date -u +%FT%TZ) $nodes node(s) x $gpus_per_node GPUs, rendezvous $head_node:${RDZV_PORT:-29500}," \
     "configs: ${configs[*]}"
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    "$python" -m torch.distributed.run \
        --nnodes "$nodes" --nproc_per_node "$gpus_per_node" \
        --rdzv-backend c10d --rdzv-endpoint "$head_node:${RDZV_PORT:-29500}" --rdzv-id "${SLURM_JOB_ID}" \
        train_disagg.py "${configs[@]}" "$@"
