"""Layer: hardware, CUDA platform; data only (no SGLang import). What the `kllm_cuda` platform
changes in SGLang, whatever plugins are enabled.

The first three are done by the process-start guard (hardware/cuda/distribution/kllm_cuda_guard.py)
before SGLang is imported; the host, which runs later, checks them in every SGLang process when the
platform is selected (`SGLANG_PLATFORM=kllm_cuda`) and lists them in docs/PATCHES.md under
`platform:kllm_cuda`. The checks and the binding live in `process_checks.py`.
"""
from __future__ import annotations

from kllm_plugins.spec import PatchSpec

_CHECKS = "kllm_plugins.hardware.cuda.process_checks"

PATCHES: tuple[PatchSpec, ...] = (
    PatchSpec(
        target="sglang.srt.utils.common.is_cuda",
        impl=f"{_CHECKS}:check_is_cuda_guarded",
        kind="registry",
        why="is_cuda() reads torch, not the selected platform, and guards module-level sgl_kernel imports in "
            "dozens of modules; made False at process start (before SGLang is imported) so SGLang takes its "
            "torch-native and Triton paths; an import of the missing sgl_kernel raises a clear ImportError",
        upstream="sgl_kernel imports guarded by the current platform (an out-of-tree CUDA platform opting out)",
    ),
    PatchSpec(
        target="sglang.srt.plugins._get_excluded_dists",
        impl=f"{_CHECKS}:check_plugins_kept",
        kind="registry",
        why="with SGLANG_PLATFORM set, SGLang skips the general plugins of every distribution that ships another "
            "platform; kllm-plugins ships kllm_cpu (inert unless selected), so selecting kllm_cuda would drop them",
        upstream="exclude only distributions whose platforms are hardware-bound (or let a platform name its plugins)",
    ),
    PatchSpec(
        target="sglang.srt.mem_cache.unified_cache.tree_core_registry.select_tree_core_backend",
        impl=f"{_CHECKS}:check_tree_core_choice",
        kind="registry",
        why="the bundled Rust TreeCore is built against the torch SGLang pins and misreads tensor dtypes under "
            "another torch; SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python is set there (logged), unless chosen",
        upstream="the Rust TreeCore fallback checking the torch it was built for, not only a version range",
    ),
    PatchSpec(
        target="sglang.srt.mem_cache.pool_host.mha",
        impl=f"{_CHECKS}:bind_direct_copy",
        kind="registry",
        why="HiCache's direct I/O backend calls sgl_kernel's transfer_kv_direct ops, imported only when "
            "is_cuda(); bind torch implementations where the names are missing (kv_tiers' staged copier, when "
            "enabled, takes the page_first_direct layout itself)",
        upstream="a torch fallback for kvcacheio ops (as _kvcacheio does for XPU)",
    ),
)
