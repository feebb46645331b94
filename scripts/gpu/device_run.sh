#!/usr/bin/env bash
# Device entry point: runs scripts/gpu/run_suite.sh on the committed tree that pack.sh archived
# (.gpu-pack/tree.tar.xz, `git archive` of one commit), not on the shared working tree the device
# tool copies, so a run is of one commit. Without the archive it runs on the copy as it is.
# Usage (the device command): KLLM_COMMIT=<sha> bash scripts/gpu/device_run.sh smoke e2e
set -uo pipefail
cd "$(dirname "$0")/../.."
HERE=$(pwd)
# SmolLM2's GGUF parts carried by this call (.gpu-pack/smollm2/p*/): kept in /tmp while the machine
# stays warm, joined by device_setup.sh once all are there
mkdir -p /tmp/kllm/smollm2
for f in .gpu-pack/smollm2/p*/*; do [ -f "$f" ] && cp "$f" /tmp/kllm/smollm2/; done
if [ -f .gpu-pack/tree.tar.xz ]; then
  rm -rf /tmp/kllm/repo && mkdir -p /tmp/kllm/repo && tar -C /tmp/kllm/repo -xJf .gpu-pack/tree.tar.xz
  ln -sfn "$HERE/.gpu-pack" /tmp/kllm/repo/.gpu-pack
  cd /tmp/kllm/repo
fi
exec bash scripts/gpu/run_suite.sh "$@"
