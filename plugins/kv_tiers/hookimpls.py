"""Layer: hook implementations (no SGLang import). Declares the kv_tiers plugin to the host."""
from __future__ import annotations

from typing import Any

from kllm_plugins.hookspecs import hookimpl
from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
from kllm_plugins.spec import OptionSpec, PatchSpec, PluginSpec, parse_bool

ADAPTER = "kllm_plugins.plugins.kv_tiers.sglang_adapter"
PREFETCH, ADMISSION = f"{ADAPTER}.prefetch", f"{ADAPTER}.admission"
MEASUREMENT, EVENTS, COPIER = f"{ADAPTER}.measurement", f"{ADAPTER}.events", f"{ADAPTER}.copier"
URC = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
MHA_HOST = "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"

_D = KvTiersConfig()


@hookimpl
def kllm_declare() -> PluginSpec:
    return PluginSpec(
        name="kv_tiers",
        summary="L2/L3 KV tiers that pay off: checked file L3 store, fetch-or-recompute, selective persistence, tier events",
        status="experimental",
        options=(
            OptionSpec("store_dir", str, _D.store_dir, "folder of the L3 file store ('' = <tmp>/kllm-kv-tiers)"),
            OptionSpec("store_capacity_gb", float, _D.store_capacity_gb, "L3 file store bound per rank (GiB)"),
            OptionSpec("fsync", parse_bool, _D.fsync, "fsync each L3 page before publishing it"),
            OptionSpec("min_reuse", int, _D.min_reuse, "sightings before a page is written to L3 (1 = all)"),
            OptionSpec("write_all_below_pressure", parse_bool, _D.write_all_below_pressure,
                       "write every page while the store has room and bandwidth; select only under pressure"),
            OptionSpec("reuse_window", int, _D.reuse_window,
                       "write-all only while one of the last N L3 lookups reused something (0: always)"),
            OptionSpec("start_active", parse_bool, _D.start_active,
                       "assume reuse at start: write all until reuse_window lookups show none"),
            OptionSpec("dormant_hold_mb", float, _D.dormant_hold_mb,
                       "MiB of pages skipped before reuse is seen, written once it is (0: dropped)"),
            OptionSpec("fill_high", float, _D.fill_high, "store fill fraction that raises the reuse bar"),
            OptionSpec("busy_high", float, _D.busy_high, "writer busy fraction that raises the reuse bar"),
            OptionSpec("fetch_margin", float, _D.fetch_margin, "fetch only when this many times cheaper than recompute"),
            OptionSpec("explore_every", int, _D.explore_every, "re-measure a refused tier every N decisions (0: never)"),
            OptionSpec("prefetch_wait_by_load", parse_bool, _D.prefetch_wait_by_load,
                       "learn the L3 prefetch round trip apart for a busy and an idle server"),
            OptionSpec("l3_read_gbps", float, _D.l3_read_gbps, "prior L3 read bandwidth (GB/s) until measured"),
            OptionSpec("l2_load_gbps", float, _D.l2_load_gbps, "prior L2->L1 bandwidth (GB/s) until measured"),
            OptionSpec("prefill_tokens_per_s", float, _D.prefill_tokens_per_s, "prior prefill speed until measured"),
            OptionSpec("prefetch_max_inflight_ops", int, _D.prefetch_max_inflight_ops, "most L3 prefetches in flight"),
            OptionSpec("prefetch_max_inflight_tokens", int, _D.prefetch_max_inflight_tokens,
                       "most tokens of L3 prefetches in flight"),
            OptionSpec("adaptive_thresholds", parse_bool, _D.adaptive_thresholds,
                       "set HiCache's prefetch / load-back thresholds from measured break-even lengths"),
            OptionSpec("admission_hold", parse_bool, _D.admission_hold,
                       "host-lock each L3-loaded L2 span until its request is admitted"),
            OptionSpec("admission_hold_fraction", float, _D.admission_hold_fraction,
                       "most of the host pool held that way at once (fraction of its tokens)"),
            OptionSpec("admission_hold_max_s", float, _D.admission_hold_max_s,
                       "release a hold after this many seconds if its request never runs"),
            OptionSpec("instance_id", str, _D.instance_id, "instance id in tier events ('' = host:port)"),
            OptionSpec("staged_copier", parse_bool, _D.staged_copier,
                       "CUDA: HiCache L1<->L2 pages through the staged copier (direct, page_first_direct)"),
            OptionSpec("staged_copier_chunk_pages", int, _D.staged_copier_chunk_pages,
                       "pages per staging buffer of the copier"),
        ),
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
