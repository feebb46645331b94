"""Layer: SGLang platform entry point of `kllm_cuda` (no SGLang import at module level).

Registered under `sglang.srt.platforms` by the `kllm-plugins-cuda` distribution
(hardware/cuda/distribution). SGLang calls `activate()` for every installed platform when
SGLANG_PLATFORM is unset, so it returns None unless the user chose this platform explicitly
(`SGLANG_PLATFORM=kllm_cuda`): on a machine with the real sgl-kernel, SGLang's own CUDA platform
stays the default. Chosen without a visible GPU, or without the process-start guard in place,
it stops the process with one line.
"""
from __future__ import annotations

import os
from typing import Callable, Mapping

PLATFORM = "kllm_cuda"
PLATFORM_CLASS = "kllm_plugins.hardware.cuda.sglang_platform.KllmCudaPlatform"


def selected(env: Mapping[str, str] | None = None) -> bool:
    """Whether the user chose the CUDA platform (`SGLANG_PLATFORM=kllm_cuda`)."""
    env = os.environ if env is None else env
    return env.get("SGLANG_PLATFORM") == PLATFORM


def _cuda_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available()) and torch.version.cuda is not None


def _guard_state() -> dict | None:
    try:
        import kllm_cuda_guard
    except ImportError:
        return None
    return kllm_cuda_guard.state


def selection_problem(env: Mapping[str, str], cuda_visible: Callable[[], bool], guard: dict | None) -> str | None:
    """Why the platform, being selected, cannot run in this process (None: it can)."""
    if env.get("SGLANG_USE_CPU_ENGINE", "").strip() not in ("", "0", "false"):
        return "kllm_cuda platform: unset SGLANG_USE_CPU_ENGINE (it switches SGLang to its CPU engine)"
    if not cuda_visible():
        return ("kllm_cuda platform: no CUDA GPU visible to torch (torch.cuda.is_available() is False); "
                "use SGLANG_PLATFORM=kllm_cpu on a machine without a GPU")
    if guard is None or not guard.get("installed"):
        return ("kllm_cuda platform: the process-start guard is not installed in this process "
                "(pip install --no-deps hardware/cuda/distribution, non-editable)")
    if guard.get("late"):
        return (f"kllm_cuda platform: the process-start guard ran after {', '.join(guard['late'])} was imported "
                "(start the process with SGLANG_PLATFORM=kllm_cuda already set)")
    return None


def activate() -> str | None:
    if not selected():
        return None
    problem = selection_problem(os.environ, _cuda_visible, _guard_state())
    if problem:
        # SystemExit passes through SGLang's platform loader: the user sees this line, not a traceback
        raise SystemExit(problem)
    return PLATFORM_CLASS
