"""Layer: SGLang platform entry point (no SGLang import at module level).

SGLang calls `activate()` for every installed platform plugin when SGLANG_PLATFORM is unset,
so this must return None unless the user chose the CPU platform explicitly: it never takes
over a GPU machine. Choose it with `SGLANG_PLATFORM=kllm_cpu` or `KLLM_DEVICE=cpu`.
"""
from __future__ import annotations

import os
from typing import Mapping

PLATFORM_CLASS = "kllm_plugins.hardware.cpu.sglang_platform.KllmCpuPlatform"


def selected(env: Mapping[str, str] | None = None) -> bool:
    """Whether the user chose the CPU platform (`SGLANG_PLATFORM=kllm_cpu` or `KLLM_DEVICE=cpu`)."""
    env = os.environ if env is None else env
    return env.get("SGLANG_PLATFORM") == "kllm_cpu" or env.get("KLLM_DEVICE") == "cpu"


def activate() -> str | None:
    if selected():
        if os.environ.get("SGLANG_USE_CPU_ENGINE", "").strip() not in ("", "0", "false"):
            raise RuntimeError(
                "kllm_cpu platform: unset SGLANG_USE_CPU_ENGINE (it switches SGLang to sgl-kernel CPU paths)"
            )
        return PLATFORM_CLASS
    return None
