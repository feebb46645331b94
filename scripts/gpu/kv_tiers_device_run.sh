#!/usr/bin/env bash
# One call on a GPU machine (no SGLang, no internet): kv_tiers' GPU tests (the staged copier, the
# one-launch page kernels, and the copier as hooked into HiCache on SGLang's buffer shapes), then the
# copy-bandwidth benchmark of the hooked SGLang layout, old (torch per layer) and new (triton) side
# by side. Usage (from the repo root, through the device tool; fits a 200 s call):
#   bash scripts/gpu/kv_tiers_device_run.sh
# Writes $OUT/gpu_tests.log, $OUT/bench.log and $OUT/kv_tiers_copy_gpu.json.
set -u
mkdir -p /tmp/shim && rm -rf /tmp/shim/kllm_plugins
cp -r kllm_plugins /tmp/shim/ && cp -r plugins /tmp/shim/kllm_plugins/plugins && cp -r hardware /tmp/shim/kllm_plugins/hardware
export PYTHONPATH=/tmp/shim PYTHONUNBUFFERED=1 KLLM_DEVICE=cuda
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if python3 -c "import pytest" 2>/dev/null; then
  # -P: the checkout's own kllm_plugins/ (without plugins/) must not shadow the shim.
  timeout 75 python3 -P -m pytest -q -p no:cacheprovider tests/gpu/test_kv_tiers_*.py > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc=$?"
  tail -3 $OUT/gpu_tests.log
else
  echo "no pytest on the device"
fi
timeout 100 python3 benchmarks/kv_tiers/bench_copy_gpu.py --sglang-layout --only-sglang --reps 15 --hooked-chunks 16,32,64,128,256 \
  --out $OUT/kv_tiers_copy_gpu.json 2>&1 | tee $OUT/bench.log
echo "bench rc=${PIPESTATUS[0]}"
