"""GPU machine smoke check of the kllm_cuda platform, in fresh processes: SGLang resolves the
platform, its process-start guard did what its ledger says (is_cuda False, kllm-plugins' general
plugin kept, TreeCore chosen, a clear error for sgl_kernel), `kllm-plugins doctor` resolves every
target, and selecting it with no GPU visible stops with one line. Writes a JSON summary."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
from sglang.srt.platforms import current_platform
from sglang.srt.utils import common
from sglang.srt import plugins
import kllm_cuda_guard as g
from kllm_plugins.hardware.cuda import process_checks as pc
try:
    import sgl_kernel  # noqa: F401
    sk = "imported"
except ImportError as exc:
    sk = str(exc)
import sglang.srt.layers.layernorm, sglang.srt.layers.sampler, sglang.srt.mem_cache.pool_host.mha  # noqa: F401
import sglang.srt.managers.scheduler  # noqa: F401
print("RESULT " + json.dumps({
    "platform": type(current_platform).__name__, "device": current_platform.device_type,
    "capabilities": {k: getattr(current_platform.capabilities, k) for k in
                     ("supports_triton", "graph_capture", "piecewise_graph", "hicache_device_kernels", "supports_pynccl")},
    "attention_default": current_platform.get_default_attention_backend(),
    "is_cuda": common.is_cuda(), "excluded_dists": sorted(plugins._get_excluded_dists()),
    "tree_core": g.state["tree_core"], "guard_late": g.state["late"], "sgl_kernel_import": sk,
    "ledger_checks": [pc.check_is_cuda_guarded()(), pc.check_plugins_kept()(), pc.check_tree_core_choice()(),
                      pc.bind_direct_copy()()],
    "import_s": round(time.perf_counter() - t0, 1)}))
"""


def run(cmd: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str]:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    env = {**os.environ, "SGLANG_PLATFORM": "kllm_cuda"}
    out: dict = {"suite": "smoke", "commit": os.environ.get("KLLM_COMMIT", "unknown")}
    t0 = time.perf_counter()
    rc, text = run([sys.executable, "-c", PROBE], env)
    line = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    out["probe"] = json.loads(line[-1][7:]) if line else {"rc": rc, "tail": text[-3000:]}
    out["probe_s"] = round(time.perf_counter() - t0, 1)
    rc, text = run([sys.executable, "-m", "kllm_plugins.cli", "doctor"], env)
    out["doctor"] = {"rc": rc, "problems": [ln for ln in text.splitlines() if "MISSING" in ln or "WARNING" in ln],
                     "platform_lines": [ln for ln in text.splitlines() if "platform:kllm_cuda" in ln]}
    rc, text = run([sys.executable, "-c", "from sglang.srt.platforms import current_platform"],
                   {**env, "CUDA_VISIBLE_DEVICES": ""})
    out["no_gpu"] = {"rc": rc, "last_line": text.strip().splitlines()[-1] if text.strip() else ""}
    p = out["probe"]
    out["ok"] = bool(p.get("platform") == "KllmCudaPlatform" and p.get("is_cuda") is False
                     and "kllm-plugins" not in p.get("excluded_dists", ["kllm-plugins"])
                     and all(p.get("ledger_checks", [False])) and out["doctor"]["rc"] == 0
                     and not out["doctor"]["problems"] and out["no_gpu"]["rc"] != 0
                     and out["no_gpu"]["last_line"].startswith("kllm_cuda platform: no CUDA GPU"))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
