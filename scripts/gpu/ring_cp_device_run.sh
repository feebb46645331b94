#!/usr/bin/env bash
# One call on the 2-GPU machine (no SGLang, no internet): the GPU sparse-kernel tests, then every
# benchmark case under one time budget. Usage (from the repo root, through the device tool):
#   bash scripts/gpu/ring_cp_device_run.sh <seconds for the whole script>
# Writes $OUT/ring_cp.json (.part while running, rewritten after every point), $OUT/bench.log and
# $OUT/gpu_tests.log. The benchmark gets what the tests leave of the time, minus a margin.
set -u
TOTAL=${1:-230}
mkdir -p /tmp/shim && rm -rf /tmp/shim/kllm_plugins
cp -r kllm_plugins /tmp/shim/ && cp -r plugins /tmp/shim/kllm_plugins/plugins && cp -r hardware /tmp/shim/kllm_plugins/hardware
export PYTHONPATH=/tmp/shim PYTHONUNBUFFERED=1 KLLM_DEVICE=cuda
nvidia-smi -L; nvidia-smi topo -m 2>&1 | head -4
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if python3 -c "import pytest" 2>/dev/null; then
  # -P: the checkout's own kllm_plugins/ (without plugins/) must not shadow the shim.
  timeout 60 python3 -P -m pytest -q -p no:cacheprovider tests/gpu/test_ring_cp_gpu.py -k "sparse or kernels_match_sdpa" \
    > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
else
  echo "no pytest on the device"
fi
DEADLINE=$((TOTAL - SECONDS - 30))
echo "bench deadline ${DEADLINE}s"
timeout $((DEADLINE + 22)) python3 benchmarks/ring_cp/bench_ring.py --gpus 2 --deadline-s "$DEADLINE" \
  --json $OUT/ring_cp.json 2>&1 | grep -v FutureWarning | grep -v "return func" | tee $OUT/bench.log
echo "bench rc=${PIPESTATUS[0]}"
