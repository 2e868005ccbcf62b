#!/usr/bin/env bash
# The accelerator checks for a short lease on one NVIDIA GPU, each mode one call of under
# 10 minutes (the README's H200 numbers come from `core`):
#   bash bench/on_gpu.sh [LOG_DIR] [core|levers]
# core:   bench/accelerator.py with both training attentions (XLA, cuDNN) and greedy decode,
#         then tests/test_gpu.py (the fused kernel against XLA's attention; CPU CI skips it).
# levers: the cuDNN train steps with scanned and unrolled layers (GemmaConfig.scan_layers), at
#         batch 2 and 4, then scanned with XLA's dynamic-slice fusion: the levers the H200
#         profile of 2026-11-30 pointed at (per-step weight stacking and ~30 device copies per
#         layer, which look like weight slices; per-step optimizer work).
set -o pipefail
logs=${1:-${OUT:-/tmp}}
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__,
                                             'optax', optax.__version__, jax.devices())"
case "${2:-core}" in
  core)
    timeout 450 python3 bench/accelerator.py --attention=xla,cudnn 2>&1 | tee "$logs/accelerator.log"
    JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
        2>&1 | tee "$logs/test_gpu.log" | tail -25 ;;
  levers)
    for b in 2 4; do
      timeout 270 python3 bench/accelerator.py --attention=cudnn --layers=scan,unrolled \
          --batch_size=$b --decode_batches= 2>&1 | tee "$logs/levers_b$b.log"
    done
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" timeout 120 \
        python3 bench/accelerator.py --attention=cudnn --decode_batches= 2>&1 \
        | tee "$logs/levers_dsfusion.log" ;;
  *) echo "unknown mode $2: use core or levers" >&2; exit 2 ;;
esac
