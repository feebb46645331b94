"""Server flags for the emulated slow L3 medium of bench_tiers.py (not collected by pytest; no SGLang
import: the backends themselves are in slow_medium.py, imported by the server processes).

With the medium on, stock HiCache runs SGLang's own `HiCacheFile` through `--hicache-storage-backend
dynamic` (subclassed only to pay the medium) and kv_tiers runs the plugin's `KllmFileStorage` (same),
so both pay the same delay on the same calls; L1 only has no L3 and is unchanged."""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

from kllm_plugins.plugins.kv_tiers.testing import HICACHE_ARGS, LAYER_FIRST, l3_args

HERE = str(Path(__file__).resolve().parent)


def medium_extra(latency_ms: float, mb_s: float, stats_dir: str) -> dict[str, Any]:
    return {"medium_latency_ms": latency_ms, "medium_mb_s": mb_s, "medium_stats_dir": stats_dir}


def medium_setup_args(name: str, store: str, latency_ms: float, mb_s: float, stats_dir: str
                      ) -> tuple[list[str], dict[str, str]]:
    """(HiCache flags, server env) of `name` ("hicache" or "kv_tiers") on the slow medium."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)}
    med = medium_extra(latency_ms, mb_s, stats_dir)
    if name == "hicache":
        cfg = {"backend_name": "slow_file", "module_path": "slow_medium", "class_name": "SlowHiCacheFile", **med}
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = store
        return HICACHE_ARGS + LAYER_FIRST + ["--hicache-storage-backend", "dynamic",
                                             "--hicache-storage-backend-extra-config", json.dumps(cfg)], env
    if name in ("kv_tiers", "kv_tiers_fixed"):
        return l3_args("kllm_file", backend_name="slow_kllm_file", module_path="slow_medium",
                       class_name="SlowKllmFileStorage", **med), env
    raise ValueError(f"no slow-medium variant of setup {name!r}")


def medium_stats(stats_dir: str) -> list[dict[str, Any]]:
    """Each server process's medium counters so far (cumulative: calls, bytes, seconds slept per kind)."""
    out = []
    for path in sorted(glob.glob(os.path.join(stats_dir, "*.json"))):
        try:
            out.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError):
            continue
    return out
