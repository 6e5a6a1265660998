#!/usr/bin/env bash
# Single-node launch: torchrun starts NPROC ranks, each running `python -m megatron_omni.cli ARGS...`.
#
#   launch/torchrun.sh [--nproc N] COMMAND [ARGS...]
#   launch/torchrun.sh --nproc 8 train --recipe qwen_image_full model.hf_path=/ckpt/Qwen-Image/transformer
#   NPROC=2 launch/torchrun.sh train --recipe qwen_image_tiny parallel.tp=2
#
# NPROC (env or --nproc) defaults to the accelerators torch sees (CUDA GPUs, or Ascend NPUs when
# torch-npu is installed), and to 1 on a CPU-only machine. PYTHON picks the interpreter (default: python).
set -euo pipefail

PYTHON="${PYTHON:-python}"
NPROC="${NPROC:-}"
if [[ "${1:-}" == "--nproc" ]]; then
  [[ $# -ge 2 ]] || { echo "torchrun.sh: --nproc needs a number" >&2; exit 2; }
  NPROC="$2"
  shift 2
fi
[[ $# -ge 1 ]] || { echo "usage: launch/torchrun.sh [--nproc N] COMMAND [ARGS...]" >&2; exit 2; }
if [[ -z "$NPROC" ]]; then
  NPROC="$("$PYTHON" -c 'import torch; a = torch.accelerator; print(a.device_count() if a.is_available() else 1)')"
fi

# --standalone: a local rendezvous on a free port, so several single-node runs can share a machine.
exec "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$NPROC" \
  -m megatron_omni.cli "$@"
