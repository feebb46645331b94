"""Layer: hook implementations (no SGLang import). Declares the incr_prefix plugin to the host."""
from __future__ import annotations

from typing import Any

from kllm_plugins.hookspecs import hookimpl
from kllm_plugins.plugins.incr_prefix.config import IncrPrefixConfig
from kllm_plugins.spec import PatchSpec, PluginSpec, options_from_config

ADAPTER = "kllm_plugins.plugins.incr_prefix.sglang_adapter"

# SGLang internals the tail insert drives (not patched, only called); a test resolves each one.
PYTHON_TREECORE_INTERNALS = (
    "sglang.srt.mem_cache.unified_cache.unified_tree_core._InsertWalkState",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core._InsertPhase",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore._advance_insert",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore._touch_node",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore._inc_hit_count_and_check",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore._build_backup_kv_action",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore.collect_full_device_indices",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint_into_tree",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.on_release",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._apply_cache_actions",
    "sglang.srt.mem_cache.registry.create_unified_radix_cache",
)


@hookimpl
def kllm_declare() -> PluginSpec:
    return PluginSpec(
        name="incr_prefix",
        summary=(
            "chunked prefill: insert only each chunk's new tail into the radix tree, resuming from "
            "the node the previous chunk locked (select with --radix-cache-backend kllm_incremental)"
        ),
        status="experimental",
        options=options_from_config(IncrPrefixConfig),
        patches=(
            PatchSpec(
                target="sglang.srt.mem_cache.registry.register_radix_cache_backend",
                impl=f"{ADAPTER}:register_backend",
                kind="registry",
                why=(
                    "UnifiedRadixCache.checkpoint_into_tree re-inserts the whole prefix from the root "
                    "after every prefill chunk; the kllm_incremental backend builds a subclass (via "
                    "create_unified_radix_cache(cache_class=...)) that inserts only the new tail"
                ),
                upstream=(
                    "an insert-from-node entry on the TreeCore interface (both Python and Rust) and "
                    "resume-from-last_node in checkpoint_into_tree"
                ),
            ),
            PatchSpec(
                target="sglang.srt.managers.schedule_policy.SchedulePolicy._compute_prefix_matches",
                impl="kllm_plugins.plugins.incr_prefix.waiting_match_memo:around_compute_prefix_matches",
                kind="around",
                why=(
                    "cache-aware policies re-match every waiting request from the root on every "
                    "scheduler pass; marking that pass lets the kllm_incremental cache answer a "
                    "re-match from the previous result when it provably still holds"
                ),
                upstream="a tree-version check in _compute_prefix_matches (skip unchanged waiting requests)",
            ),
        ),
        config_factory=IncrPrefixConfig,
    )


BACKEND = "kllm_incremental"


@hookimpl
def kllm_select_features(config: Any, server_args: Any) -> str | None:
    """Select the plugin's radix-cache backend when the user chose none (and the radix cache is on)."""
    if getattr(server_args, "radix_cache_backend", None) is not None:
        return None
    if getattr(server_args, "disable_radix_cache", False) or getattr(server_args, "enable_unified_cache_external_linker", False):
        return None
    server_args.radix_cache_backend = BACKEND
    return f"selected --radix-cache-backend {BACKEND} (none was given)"


@hookimpl
def kllm_readiness(config: Any, server_args: Any) -> str | None:
    """The tail-only insert lives in the kllm_incremental radix cache."""
    if isinstance(config, IncrPrefixConfig) and not config.enabled:
        return "--kllm-incr-prefix-enabled is false; chunk checkpoints keep SGLang's whole-prefix insert"
    if getattr(server_args, "disable_radix_cache", False):
        return f"the radix cache is disabled (--disable-radix-cache); drop it and add --radix-cache-backend {BACKEND}"
    backend = getattr(server_args, "radix_cache_backend", None)
    if backend != BACKEND:
        return f"incr_prefix needs --radix-cache-backend {BACKEND} (got {backend or 'the default cache'})"
    return None
