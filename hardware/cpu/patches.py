"""Layer: hardware, CPU platform; data only (no SGLang import). The SGLang patches the `kllm_cpu`
platform needs, whatever plugins are enabled.

The host applies this list in every SGLang process when the CPU platform is selected
(`SGLANG_PLATFORM=kllm_cpu` or `KLLM_DEVICE=cpu`), verifies each target like a plugin's, and
lists it in docs/PATCHES.md under `platform:kllm_cpu`. The implementations live in
`hicache_compat.py` (and `kv_direct_copy.py`): HiCache's host pools and direct I/O ops assume
CUDA-like platforms.
"""
from __future__ import annotations

from kllm_plugins.spec import PatchSpec

_COMPAT = "kllm_plugins.hardware.cpu.hicache_compat"

PATCHES: tuple[PatchSpec, ...] = (
    PatchSpec(
        target="sglang.srt.mem_cache.pool_host.base.HostKVCache.__init__",
        impl=f"{_COMPAT}:unpin_host_pool",
        kind="before",
        why="HiCache host pools are built with pin_memory=True (cudaHostRegister, pinned page buffers), which "
            "fails without CUDA; build them unpinned where the platform reports no pinned memory",
        upstream="host pools honouring current_platform.is_pin_memory_available()",
    ),
    PatchSpec(
        target="sglang.srt.mem_cache.pool_host.mha",
        impl=f"{_COMPAT}:bind_direct_copy",
        kind="registry",
        why="HiCache's direct I/O backend calls sgl_kernel's transfer_kv_direct, imported only on CUDA/HIP/XPU; "
            "bind torch implementations where the names are missing",
        upstream="a torch fallback for kvcacheio ops (as _kvcacheio does for XPU)",
    ),
)
