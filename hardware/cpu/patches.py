"""Layer: hardware, CPU platform; data only (no SGLang import). The SGLang patches the `kllm_cpu`
platform needs, whatever plugins are enabled.

The host applies this list in every SGLang process when the CPU platform is selected
(`SGLANG_PLATFORM=kllm_cpu` or `KLLM_DEVICE=cpu`), verifies each target like a plugin's, and
lists it in docs/PATCHES.md under `platform:kllm_cpu`. The implementations live in
`hicache_compat.py` (with `kv_direct_copy.py` and `kv_kernel_copy.py`): HiCache's host pools and
I/O ops assume CUDA-like platforms; `server_args_check.py` refuses at start-up what the platform
cannot serve.
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
        why="HiCache's direct and kernel (default) I/O backends call sgl_kernel's kvcacheio ops, imported only on "
            "CUDA/HIP/XPU (the first L2 write raises NameError); bind torch implementations where the names are "
            "missing (direct: layer_first, page_first_direct; kernel: layer_first, page_first)",
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
    PatchSpec(
        target="sglang.srt.server_args.ServerArgs.resolve_once",
        impl="kllm_plugins.hardware.cpu.server_args_check:after_resolve_once",
        kind="after",
        why="refuse at start-up, in one line, what the CPU platform cannot serve (HiCache io-backend/layout "
            "pairs without a torch copy, such as page_head; --attn-cp-size > 1, which torch_native has no CP "
            "attention for) instead of a scheduler crash on the first batch",
        upstream="a platform hook that validates resolved server arguments (SRTPlatform.check_server_args)",
    ),
    PatchSpec(
        target="sglang.srt.server_args.ServerArgs.resolve_once",
        impl="kllm_plugins.hardware.cpu.server_args_check:before_resolve_once",
        kind="before",
        why="refuse --attn-cp-size > 1 on the CPU in one line before SGLang's own CP resolution (assertions "
            "with a traceback, then a scheduler crash on a shape mismatch: torch_native has no CP attention)",
        upstream="a platform hook that validates server arguments before resolution",
    ),
)
