"""Layer: hook implementations (no SGLang import). Declares the kv_tiers plugin to the host."""
from __future__ import annotations

from typing import Any

from kllm_plugins.hookspecs import hookimpl
from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
from kllm_plugins.spec import PatchSpec, PluginSpec, options_from_config

ADAPTER = "kllm_plugins.plugins.kv_tiers.sglang_adapter"
PREFETCH, ADMISSION = f"{ADAPTER}.prefetch", f"{ADAPTER}.admission"
MEASUREMENT, EVENTS, COPIER = f"{ADAPTER}.measurement", f"{ADAPTER}.events", f"{ADAPTER}.copier"
URC = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
MHA_HOST = "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"


@hookimpl
def kllm_declare() -> PluginSpec:
    return PluginSpec(
        name="kv_tiers",
        summary="L2/L3 KV tiers that pay off: checked file L3 store, fetch-or-recompute, selective persistence, tier events",
        status="experimental",
        options=options_from_config(KvTiersConfig),
        patches=(
            PatchSpec(
                target=f"{URC}.prefetch_from_storage",
                impl=f"{PREFETCH}:around_prefetch_from_storage",
                kind="around",
                why="fetch-or-recompute and bounded prefetch: set the L3 prefetch threshold from the measured "
                    "break-even length, refuse prefetches beyond the in-flight budget, and start none whose first "
                    "page the L3 store does not hold (a miss would hold its request under the `timeout` policy)",
                upstream="a pluggable storage prefetch policy (threshold and admission callback) in HiCache, and "
                         "a miss ending a `timeout`-policy prefetch at once",
            ),
            PatchSpec(
                target=f"{URC}.check_prefetch_progress",
                impl=f"{MEASUREMENT}:after_check_prefetch_progress",
                kind="after",
                why="measure what an L3 prefetch costs the request that waits for it (start to done, under "
                    "HiCache's default 'timeout' stop policy), the fetch cost that fetch-or-recompute weighs",
                upstream="per-request prefetch timings exposed by HiCache (time_stats already observes readiness)",
            ),
            PatchSpec(
                target=f"{URC}._handle_prefetch_result",
                impl=f"{ADMISSION}:after_handle_prefetch_result",
                kind="after",
                why="admission hold: host-lock the span a finished L3 prefetch has just inserted into the host "
                    "tree (unlocked, from the storage ack drain of any scheduler pass) until its request is admitted",
                upstream="HiCache keeping a request's prefetched span locked until its admission (today the span "
                         "is inserted unlocked and can be evicted first: cache_admission_shortfall)",
            ),
            PatchSpec(
                target="sglang.srt.managers.scheduler.Scheduler._process_hicache_events",
                impl=f"{PREFETCH}:after_process_hicache_events",
                kind="after",
                why="prefetch just in time: re-issue, in waiting-queue order, the L3 prefetches the gate deferred "
                    "for want of room (in flight or in L2) once room frees; and note whether requests wait (a busy "
                    "server's prefetch round trip is learned and priced apart from an idle one's)",
                upstream="a deferrable prefetch admission in HiCache (its paced retries cancel the queue head's "
                         "and count against a small attempt cap)",
            ),
            PatchSpec(
                target=f"{URC}.finish_storage_prefetch_admission",
                impl=f"{ADMISSION}:after_finish_storage_prefetch_admission",
                kind="after",
                why="admission hold: a request is admitted, so the L3-loaded L2 span held for it is released",
                upstream="as for _handle_prefetch_result",
            ),
            PatchSpec(
                target=f"{URC}.release_aborted_request",
                impl=f"{ADMISSION}:after_release_aborted_request",
                kind="after",
                why="admission hold: an aborted request's held span is released",
                upstream="as for _handle_prefetch_result",
            ),
            PatchSpec(
                target=f"{URC}.reset",
                impl=f"{ADMISSION}:after_reset",
                kind="after",
                why="admission hold: a flush rebuilds the radix tree, so the held nodes and their locks are gone; "
                    "the holds are dropped without releasing (their node ids may name new nodes)",
                upstream="as for _handle_prefetch_result",
            ),
            PatchSpec(
                target=f"{URC}.init_load_back",
                impl=f"{MEASUREMENT}:around_init_load_back",
                kind="around",
                why="fetch-or-recompute for L2 hits: set load_back_threshold from the measured break-even length, "
                    "and measure L2->L1 loads",
                upstream="a load-back cost hook or a measured threshold in HiCache",
            ),
            PatchSpec(
                target="sglang.srt.managers.scheduler.Scheduler.run_batch",
                impl=f"{MEASUREMENT}:around_run_batch",
                kind="around",
                why="measure the instance's prefill speed (tokens per second of extend batches) online",
                upstream="per-batch forward timings exposed to plugins (a batch-finished observer)",
            ),
            PatchSpec(
                target=f"{URC}.take_events",
                impl=f"{EVENTS}:after_take_events",
                kind="after",
                why="append L3 (DISK) store/remove events to the radix cache's KV events; the tree core emits "
                    "GPU and CPU media only",
                upstream="KV events from the HiCache storage threads (record_store with StorageMedium.DISK/EXTERNAL)",
            ),
            PatchSpec(
                target=f"{MHA_HOST}.backup_from_device_all_layer",
                impl=f"{COPIER}:around_backup_from_device_all_layer",
                kind="around",
                why="on CUDA (direct I/O, page_first_direct host layout) write pages to L2 through the staged "
                    "copier: gathered on the device, one DMA per run of host pages; elsewhere SGLang's own copy",
                upstream="a pluggable host<->device transfer in HiCache's host pools (or a staged kvcacheio op)",
            ),
            PatchSpec(
                target=f"{MHA_HOST}.load_to_device_per_layer",
                impl=f"{COPIER}:around_load_to_device_per_layer",
                kind="around",
                why="on CUDA (direct I/O, page_first_direct host layout) load L2 pages through the staged "
                    "copier, all layers at the first layer's call; elsewhere SGLang's own copy",
                upstream="a pluggable host<->device transfer in HiCache's host pools (or a staged kvcacheio op)",
            ),
            PatchSpec(
                target="sglang.srt.managers.cache_controller.HiCacheController.move_indices",
                impl=f"{COPIER}:around_move_indices",
                kind="around",
                why="where the staged copier takes an L1<->L2 transfer, keep its device indices on the GPU: the "
                    "direct backend's .cpu() waits on the scheduler's thread for the forward pass in flight",
                upstream="device-side indices for the direct I/O backend (as its kernel backend has)",
            ),
            PatchSpec(
                target="sglang.srt.disaggregation.kv_events.EventPublisherFactory.register_publisher",
                impl=f"{EVENTS}:register_publisher",
                kind="registry",
                why="a 'kllm_tiers' KV-event publisher (ZMQ) that stamps every event with the instance id",
                upstream="an instance id in SGLang's KV event batch",
            ),
        ),
        config_factory=KvTiersConfig,
    )


KLLM_FILE_EXTRA = ('{"backend_name":"kllm_file","module_path":"kllm_plugins.plugins.kv_tiers.sglang_adapter",'
                   '"class_name":"KllmFileStorage","hicache_storage_pass_prefix_keys":true}')
MINIMAL_FLAGS = ("--enable-hierarchical-cache --hicache-io-backend direct --hicache-mem-layout layer_first "
                 f"--hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{KLLM_FILE_EXTRA}'")


@hookimpl
def kllm_readiness(config: Any, server_args: Any) -> str | None:
    """Every kv_tiers hook sits on HiCache (its radix cache, host pools and storage threads)."""
    if not getattr(server_args, "enable_hierarchical_cache", False):
        return f"kv_tiers attaches to HiCache, which is off; add {MINIMAL_FLAGS}"
    return None
