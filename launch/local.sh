#!/usr/bin/env bash
# Local launcher: set up the environment (once), then train with torchrun on this machine.
#
#   bash launch/local.sh                       # embedded default: tiny GPT-MoE, real text, 4 CPU ranks, fssdp
#   bash launch/local.sh --moe-parallel-mode ep   # the baseline: Megatron's expert parallelism
#   NPROC=2 bash launch/local.sh --train-iters 50 --moe-parallel-mode replicate
#   DEVICE=gpu NPROC=8 bash launch/local.sh --config configs/models/gpt_moe_s.yaml --micro-batch-size 1 \
#       --train-iters 500 --lr 2e-4 --data-path ...
#
# Knobs (environment): NPROC ranks (default 4), DEVICE cpu|gpu (default cpu: CUDA is hidden
# so the run uses gloo and the CPU shims), MODE the --moe-parallel-mode (default fssdp, whose
# progress lines show the imbalance ep would have had on the same routing beside fssdp's; not
# applied when the arguments give --moe-parallel-mode or a --config, which may set the mode
# itself: the command line would override it), OMP_NUM_THREADS per rank (default 1: the ranks
# share the cores), RUN_DIR the run folder (default runs/local-<date>-<time>: arguments.txt,
# metrics.jsonl, tensorboard/, loads.npz, loss_imbalance.png). Every other argument goes to
# pretrain_gpt_moe.py unchanged (a --run-dir there wins).
set -eo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-4}
DEVICE=${DEVICE:-cpu}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
RUN_DIR=${RUN_DIR:-runs/local-$(date +%Y%m%d-%H%M%S)}

bash tools/setup_env.sh

launcher_args=(--standalone --nproc-per-node "$NPROC")
mode_args=(--moe-parallel-mode "${MODE:-fssdp}")
if [ -z "${MODE:-}" ]; then
  for arg in "$@"; do
    case "$arg" in
      --moe-parallel-mode|--moe-parallel-mode=*|--config|--config=*) mode_args=() ;;
    esac
  done
fi
device_args=()
if [ "$DEVICE" = cpu ]; then
  device_args=(--cpu)
elif [ "$DEVICE" != gpu ]; then
  echo "launch/local.sh: DEVICE=$DEVICE is not valid; use cpu or gpu" >&2
  exit 2
fi

echo "[local] git revision $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $NPROC ranks on $DEVICE, started $(date -Is)"
.venv/bin/python -m torch.distributed.run "${launcher_args[@]}" pretrain_gpt_moe.py "${device_args[@]}" \
  "${mode_args[@]}" --run-dir "$RUN_DIR" "$@"
echo "[local] finished $(date -Is)"
