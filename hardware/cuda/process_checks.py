"""Layer: hardware, CUDA platform; SGLang adapter. The ledger's checks of what the process-start
guard (hardware/cuda/distribution/kllm_cuda_guard.py) did in this process.

Each function is a `registry` entry of `patches.py`: called once by the host in every SGLang
process, it returns the check the host runs (and `KLLM_STRICT=1` enforces). The guard itself acts
before SGLang is imported; these only confirm it, so a process where it did not run is reported
instead of serving on the wrong code paths.
"""
from __future__ import annotations

from typing import Callable


def _guard():
    import kllm_cuda_guard

    return kllm_cuda_guard


def check_is_cuda_guarded() -> Callable[[], bool]:
    guard = _guard()

    def check() -> bool:
        from sglang.srt.utils import common

        return (guard.state["installed"] and not guard.state["late"] and common.is_cuda is guard.guarded_is_cuda
                and common.is_cuda() is False)

    return check


def check_plugins_kept() -> Callable[[], bool]:
    def check() -> bool:
        from sglang.srt import plugins

        return bool(getattr(plugins._get_excluded_dists, "_kllm_guard", False))

    return check


def check_tree_core_choice() -> Callable[[], bool]:
    guard = _guard()

    def check() -> bool:
        import os

        decided = guard.state["tree_core"]
        return decided is not None and os.environ.get(guard.TREE_CORE_ENV, "rust") == decided[0]

    return check


def bind_direct_copy() -> Callable[[], bool]:
    """HiCache's `direct` I/O ops (sgl_kernel.kvcacheio) as torch index copies, which run on CUDA
    tensors as on CPU ones (the CPU platform's implementation, hardware/cpu/kv_direct_copy.py)."""
    from kllm_plugins.hardware.cpu.hicache_compat import bind_direct_copy as bind

    return bind()
