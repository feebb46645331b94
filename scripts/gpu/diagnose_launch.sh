#!/usr/bin/env bash
# Device diagnostic: install the pack (device_setup.sh), then show what the launcher sees of the
# plugins on kllm_cuda: entry points, SGLang's plugin exclusion, `kllm-plugins doctor`, and one
# server (tiny model, trace plugin, strict) with its full log and one request. Writes under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kllm/out}; mkdir -p "$OUT" /tmp/kllm
bash scripts/gpu/device_setup.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
tail -2 "$OUT/setup.log"
export KLLM_CACHE_DIR=/tmp/kllm/cache PYTHONUNBUFFERED=1 SGLANG_PLATFORM=kllm_cuda
python3 - > "$OUT/entry_points.txt" 2>&1 <<'PY'
import importlib.metadata as md
for g in ("sglang.srt.plugins", "sglang.srt.platforms", "kllm_plugins"):
    print(g, [(e.name, e.value, e.dist.name if e.dist else None) for e in md.entry_points(group=g)])
import sglang.srt.utils.common as c
print("is_cuda", c.is_cuda())
from sglang.srt import plugins as p
print("loader attrs", [a for a in dir(p) if not a.startswith("__")])
PY
python3 -m kllm_plugins.cli doctor > "$OUT/doctor.txt" 2>&1; echo "doctor rc=$?" >> "$OUT/doctor.txt"
MODEL=$(python3 -c "from kllm_plugins.models.tiny_llama import tiny_llama_path; print(tiny_llama_path())" 2>>"$OUT/model.log")
echo "model $MODEL"
KLLM_STRICT=1 timeout 300 python3 -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port 30111 \
  --enable-plugin trace --sampling-backend pytorch --disable-cuda-graph --mem-fraction-static 0.3 \
  > "$OUT/server.log" 2>&1 &
SP=$!
for i in $(seq 1 240); do
  curl -sf http://127.0.0.1:30111/health >/dev/null 2>&1 && break
  kill -0 $SP 2>/dev/null || break; sleep 1
done
curl -s http://127.0.0.1:30111/generate -H 'content-type: application/json' \
  -d '{"text":"def add(a, b):","sampling_params":{"max_new_tokens":16,"temperature":0}}' > "$OUT/generate.json" 2>&1
curl -s http://127.0.0.1:30111/kllm/plugins > "$OUT/kllm_plugins.json" 2>&1
curl -s http://127.0.0.1:30111/kllm/stats > "$OUT/kllm_stats.json" 2>&1
kill $SP 2>/dev/null; sleep 2; pkill -f sglang 2>/dev/null
cat "$OUT/entry_points.txt"; tail -3 "$OUT/doctor.txt"; grep -E "kllm-plugins|error|Error" "$OUT/server.log" | head -20
echo "generate: $(head -c 300 "$OUT/generate.json")"; echo "stats: $(head -c 300 "$OUT/kllm_stats.json")"
