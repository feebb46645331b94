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
    PatchSpec(
        target="sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend",
        impl="kllm_plugins.hardware.cpu.extend_attention:around_sdpa_forward_extend",
        kind="around",
        why="the torch-native extend pads each sequence's new queries to its whole length and attends over the "
            "full square, so a cached prefix still costs its attention (40% of an L3 hit's request time on CPU); "
            "compute only the new tokens' rows under a causal mask shifted by the prefix, as GPU backends do",
        upstream="a prefix-aware extend in TorchNativeAttnBackend (its own TODO)",
    ),
)
