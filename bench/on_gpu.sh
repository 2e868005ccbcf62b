#!/usr/bin/env bash
# Every accelerator check in one call, for a short lease on one NVIDIA GPU (the README's H200
# numbers come from it):  bash bench/on_gpu.sh [LOG_DIR]
# 1. bench/accelerator.py with both training attentions (XLA and the cuDNN fused kernel);
# 2. tests/test_gpu.py (the fused kernel against XLA's attention; skipped on CPU CI);
# 3. the cuDNN train steps again at batch 4, to see how much of the step is per-step work
#    (optimizer, weight stacking) that a larger batch amortises.
set -o pipefail
logs=${1:-${OUT:-/tmp}}
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__,
                                             'optax', optax.__version__, jax.devices())"
timeout "${BENCH_TIMEOUT:-450}" python3 bench/accelerator.py --attention=xla,cudnn 2>&1 \
    | tee "$logs/accelerator.log"
JAX_PLATFORMS=cuda timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider \
    tests/test_gpu.py 2>&1 | tee "$logs/test_gpu.log" | tail -25
timeout "${BATCH_TIMEOUT:-150}" python3 bench/accelerator.py --attention=cudnn --batch_size=4 \
    --decode_batches= 2>&1 | tee "$logs/accelerator_b4.log" | grep -E "^BENCH|FAILED"
