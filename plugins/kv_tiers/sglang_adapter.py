"""Layer: SGLang adapter of the kv_tiers plugin. The only module of the plugin that touches SGLang.

- `KllmFileStorage`: a `HiCacheStorage` for HiCache's `dynamic` backend, backed by the core
  `FilePageStore` (checked, bounded pages) and the core `PersistencePolicy` (selective writes).
  Select it with
      --enable-hierarchical-cache --hicache-storage-backend dynamic
      --hicache-storage-backend-extra-config '{"backend_name":"kllm_file",
          "module_path":"kllm_plugins.plugins.kv_tiers.sglang_adapter","class_name":"KllmFileStorage"}'
  It works without the plugin enabled (defaults, or keys of the extra config), and takes the
  plugin's options when it is.
- hooks: adaptive L3 prefetch / L2 load-back thresholds and the bounded prefetch gate
  (fetch-or-recompute), prefill-speed and L2-load measurement, tier events appended to the
  radix cache's own KV events, an unpinned host pool on platforms without pinned memory, and a
  `kllm_tiers` KV-event publisher that stamps the instance id.
"""
from __future__ import annotations

import logging
import math
from array import array
import os
import socket
import tempfile
import threading
import time
from typing import Any, Callable, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kllm_plugins import metrics, runtime
from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
from kllm_plugins.plugins.kv_tiers.core.admission_hold import AdmissionHolds
from kllm_plugins.plugins.kv_tiers.core.cost_model import CostPrior
from kllm_plugins.plugins.kv_tiers.core.fetch_policy import FetchOrRecompute
from kllm_plugins.plugins.kv_tiers.core.file_store import FilePageStore, StoreStats
from kllm_plugins.plugins.kv_tiers.core.held_pages import HeldPages
from kllm_plugins.plugins.kv_tiers.core.host_pages import PageBlocks
from kllm_plugins.plugins.kv_tiers.core.persistence import BusyMeter, PersistencePolicy
from kllm_plugins.plugins.kv_tiers.core.prefetch_gate import PrefetchGate
from kllm_plugins.plugins.kv_tiers.core.tier_events import TierEventLog

logger = logging.getLogger("kllm.kv_tiers")

PLUGIN = "kv_tiers"
_NO_FETCH_THRESHOLD = 1 << 30  # "never": longer than any context
_NEVER_LOG_EVERY_S = 60.0  # a tier's worth-fetching turns are logged at most this often


_MAX_TRACKED = 4096  # per-request maps keep at most this many entries (requests that never come back)


def _trim_oldest(d: dict[Any, Any]) -> list[Any]:
    """Drop the older half of `d` once it holds more than `_MAX_TRACKED` requests (aborted or
    otherwise never seen again); the keys dropped."""
    if len(d) <= _MAX_TRACKED:
        return []
    dropped = list(d)[: _MAX_TRACKED // 2]
    for key in dropped:
        del d[key]
    return dropped


def _config(extra: dict[str, Any] | None = None) -> KvTiersConfig:
    """The plugin's config when enabled here; otherwise defaults overridden by extra-config keys."""
    if runtime.is_enabled(PLUGIN):
        return runtime.config_of(PLUGIN)
    fields = KvTiersConfig.__dataclass_fields__
    given = {k: v for k, v in (extra or {}).items() if k in fields}
    return KvTiersConfig(**given)


def _instance_id(cfg: KvTiersConfig) -> str:
    if cfg.instance_id:
        return cfg.instance_id
    try:
        from sglang.srt.runtime_context import get_server_args

        port = get_server_args().port
    except Exception:
        port = os.getpid()
    return f"{socket.gethostname()}:{port}"


def extends_cached_prefix(extra_info: Any) -> bool:
    """Whether an L3 lookup is for a request that matched a prefix in L1/L2 (HiCache passes the
    matched prefix's keys when `hicache_storage_pass_prefix_keys` is set in the extra config)."""
    return bool(getattr(extra_info, "prefix_keys", None))


class _Tiers:
    """Per-process state shared by the storage backend and the hooks."""

    def __init__(self, cfg: KvTiersConfig) -> None:
        self.cfg = cfg
        self.instance_id = _instance_id(cfg)
        self.fetch: FetchOrRecompute | None = None  # built once the KV size per token is known
        self.persistence = PersistencePolicy(cfg.min_reuse, cfg.fill_high, cfg.busy_high,
                                             write_all_below_pressure=cfg.write_all_below_pressure,
                                             reuse_window=cfg.reuse_window, start_active=cfg.start_active)
        self.held = HeldPages(int(cfg.dormant_hold_mb * (1 << 20)))
        self.gate = PrefetchGate(cfg.prefetch_max_inflight_ops, cfg.prefetch_max_inflight_tokens)
        self.write_busy = BusyMeter()
        self.events: TierEventLog | None = None
        self.store: FilePageStore | None = None
        # whether the first page a prefetch would look up is in L3 (set by the backend: the file
        # store's existence check, Mooncake's bounded one); None = no probe, HiCache's lookup decides
        self.probe: Callable[[str], bool] | None = None
        self.backend_stats: StoreStats | None = None  # a store other than the file store (Mooncake)
        self.backend_name = "file"
        self.counts: dict[str, int] = {"prefetch_admitted": 0, "prefetch_refused": 0,
                                       "pages_skipped": 0, "pages_admitted": 0}
        # wall seconds and calls spent in this plugin's L3 path (lookups, reads, writes incl. offer
        # markers): what a workload pays for the tiers beyond HiCache itself
        self.path_s: dict[str, float] = {"lookup": 0.0, "read": 0.0, "write": 0.0, "l2_backup": 0.0, "probe": 0.0}
        self.path_calls: dict[str, int] = {"lookup": 0, "read": 0, "write": 0, "l2_backup": 0, "probe": 0}
        # L3 prefetches in flight: request handle -> start time, and the time the scheduler first
        # wanted to run the request but had to wait for its prefetch (HiCache's default "timeout"
        # stop policy): from then to done is what an L3 fetch delays the request (time spent
        # queued behind other work while the prefetch ran costs nothing)
        self.prefetch_started: dict[Any, float] = {}
        self.prefetch_blocked: dict[Any, float] = {}
        self.prefetch_wait: dict[str, float] = {"calls": 0, "seconds": 0.0, "max_s": 0.0, "loaded_tokens": 0,
                                                "misses": 0, "miss_seconds": 0.0}
        # L3-loaded L2 spans host-locked until their request is admitted (built with the host pool's
        # size at the first span), and the token key of each prefetch in flight that would need one
        self.holds: AdmissionHolds[tuple[Any, Any]] | None = None
        self.prefetch_spans: dict[Any, tuple[array[int], Any, Any]] = {}
        # queued requests whose prefetch waits for room (in flight or L2 budget): re-issued in queue order;
        # and the (ops, tokens in flight, tokens held) at the last re-issue that found no room
        self.deferred: dict[Any, None] = {}
        self.deferred_room: tuple[int, int, int] | None = None
        self.waiting = 0  # the scheduler's waiting queue at its last pass (busy: fetch_policy's overhead)
        self._lock = threading.Lock()
        self._never: dict[str, bool] = {}
        self._never_logged: dict[str, float] = {}
        self._m_pages = metrics.counter("kllm_kv_tiers_l3_pages_total", "L3 pages by outcome", ("outcome",))
        self._m_faults = metrics.counter("kllm_kv_tiers_l3_faults_total", "L3 pages refused or failed, by reason",
                                         ("reason",))
        self._m_prefetch = metrics.counter("kllm_kv_tiers_prefetch_decisions_total", "L3 prefetch gate decisions",
                                           ("reason",))
        self._m_holds = metrics.counter("kllm_kv_tiers_admission_holds_total",
                                        "L3-loaded L2 spans held until admission, by outcome", ("outcome",))

    def start_stats(self, interval_s: float = 0.5) -> None:
        """Publish snapshots for GET /kllm/stats from a daemon thread (only when they change)."""
        from kllm_plugins.stats import StatsWriter

        writer = StatsWriter(PLUGIN, interval_s)

        def loop() -> None:
            last: Any = None
            while True:
                time.sleep(interval_s)
                try:
                    snap = self.snapshot()
                    if snap != last:
                        writer.write(snap)
                        last = snap
                except Exception:  # never let stats kill serving
                    logger.debug("kv_tiers stats write failed", exc_info=True)

        threading.Thread(target=loop, name="kllm-kv-tiers-stats", daemon=True).start()

    def ensure_fetch_policy(self, bytes_per_token: int) -> FetchOrRecompute:
        with self._lock:
            if self.fetch is None:
                c = self.cfg
                self.fetch = FetchOrRecompute(
                    max(1, bytes_per_token),
                    l2_prior=CostPrior(20e-6, 1.0 / (c.l2_load_gbps * 1e9)),
                    l3_prior=CostPrior(200e-6, 1.0 / (c.l3_read_gbps * 1e9)),
                    prefill_prior=CostPrior(0.0, 1.0 / c.prefill_tokens_per_s),
                    margin=c.fetch_margin,
                    explore_every=c.explore_every,
                )
            return self.fetch

    def fault(self, reason: str, n: int = 1) -> None:
        """Count `n` L3 pages (or calls) refused or failed for `reason` (metric and snapshot)."""
        with self._lock:
            if self.backend_stats is not None:
                self.backend_stats.faults[reason] = self.backend_stats.faults.get(reason, 0) + n
        self._m_faults.labels(reason).inc(n)

    def note_threshold(self, tier: str, min_tokens: float, request_tokens: int | None = None) -> None:
        """Log each time a tier turns from worth fetching to not (or back), at most once a minute:
        with a slow or overloaded store every hit is recomputed, and the log says so and why. "Not"
        = no hit is worth it, or none within the request (`request_tokens`): the break-even length
        depends on the request's length, so requests of mixed lengths can alternate."""
        never = min_tokens == float("inf") or (request_tokens is not None and min_tokens > request_tokens)
        now = time.monotonic()
        with self._lock:
            turned = never != bool(self._never.get(tier))  # a first answer counts only as "never"
            self._never[tier] = never
            if not turned or now - self._never_logged.get(tier, -math.inf) < _NEVER_LOG_EVERY_S:
                return
            self._never_logged[tier] = now
        if self.fetch is None:
            return
        snap = self.fetch.snapshot()
        if never:
            self._m_faults.labels(f"{tier}_slower_than_recompute").inc()
            logger.warning("kv_tiers: %s is slower than recomputing (measured %.3f GB/s, %.1f ms latency; prefill "
                           "%.0f tokens/s): its hits are recomputed until it speeds up", tier,
                           snap[f"{tier}_bandwidth_bytes_per_s"] / 1e9, snap[f"{tier}_latency_s"] * 1e3,
                           snap["prefill_tokens_per_s"])
        else:
            logger.info("kv_tiers: %s worth fetching again for hits of %d tokens and more", tier, int(min_tokens))

    def spent(self, what: str, seconds: float) -> None:
        with self._lock:
            self.path_s[what] += seconds
            self.path_calls[what] += 1

    def note_lookup(self, keys: list[str], hits: int, extends: bool) -> None:
        """What an L3 lookup tells selective persistence: `hits` leading pages of `keys` were in L3,
        `extends` = the request matched a cached prefix (a continuation)."""
        self.persistence.note_request(bool(hits) or extends)
        logger.debug("kv_tiers lookup: %d of %d pages in L3 (continuation: %s)", hits, len(keys), extends)
        if hits < len(keys):
            self.persistence.note_lookup_miss(keys[hits:])
            if hits or extends:
                self.persistence.note_continuation(keys[hits:])

    def busy(self) -> bool:
        """Requests waited at the scheduler's last pass (and the busy/idle split is on)."""
        return self.cfg.prefetch_wait_by_load and self.waiting > 0

    def prefetch_begun(self, request: Any) -> None:
        with self._lock:
            for key in _trim_oldest(self.prefetch_started):  # aborted requests never complete
                self.prefetch_blocked.pop(key, None)
            self.prefetch_started.setdefault(request, time.perf_counter())

    def prefetch_blocking(self, request: Any) -> None:
        """The scheduler would run the request now but waits for its prefetch."""
        with self._lock:
            if request in self.prefetch_started:
                self.prefetch_blocked.setdefault(request, time.perf_counter())

    def prefetch_done(self, request: Any, loaded_tokens: int) -> float | None:
        """Record a finished L3 prefetch and how long it held its request up (0 when it finished while
        the request was still queued); those seconds, or None for a request not seen starting one."""
        with self._lock:
            t0 = self.prefetch_started.pop(request, None)
            blocked = self.prefetch_blocked.pop(request, None)
            if t0 is None:
                return None
            wait = time.perf_counter() - blocked if blocked is not None else 0.0
            w = self.prefetch_wait
            w["calls"] += 1
            w["seconds"] += wait
            w["max_s"] = max(w["max_s"], wait)
            w["loaded_tokens"] += loaded_tokens
            if loaded_tokens <= 0:
                w["misses"] += 1
                w["miss_seconds"] += wait
        return wait

    def hold_event(self, outcome: str, counted: bool = False) -> None:
        """One outcome of the admission hold, in the metric and (unless `AdmissionHolds` counted it
        itself: held, admitted, aborted, expired, over_budget) in the snapshot."""
        if not counted and self.holds is not None:
            self.holds.note(outcome)
        self._m_holds.labels(outcome).inc()

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {"instance_id": self.instance_id, **self.counts,
                                   "path_s": dict(self.path_s), "path_calls": dict(self.path_calls),
                                   "prefetch_wait": dict(self.prefetch_wait)}
        out["write_mode"] = "dormant" if self.persistence.dormant() else "active"
        out["held"] = {"pages": len(self.held), "bytes": self.held.nbytes, "held": self.held.held,
                       "dropped": self.held.dropped}
        if self.store is not None:
            out["store"] = self.store.stats.snapshot()
            out["store_used_bytes"] = self.store.used_bytes
        elif self.backend_stats is not None:
            with self._lock:
                out["store"] = self.backend_stats.snapshot()
        out["backend"] = self.backend_name
        if self.fetch is not None:
            out["fetch_policy"] = self.fetch.snapshot()
        if self.holds is not None:
            out["admission_holds"] = self.holds.snapshot()
        return out


_tiers: _Tiers | None = None
_tiers_lock = threading.Lock()


def tiers(extra: dict[str, Any] | None = None) -> _Tiers:
    global _tiers
    with _tiers_lock:
        if _tiers is None:
            _tiers = _Tiers(_config(extra))
            if runtime.is_enabled(PLUGIN):
                _tiers.start_stats()
        return _tiers


# -- the L3 store ----------------------------------------------------------------------------


class KllmFileStorage(HiCacheStorage):
    """HiCache `dynamic` storage backend over the checked, bounded `FilePageStore`."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.t = tiers(extra)
        cfg = self.t.cfg
        self.storage_config = storage_config
        self.root = cfg.store_dir or extra.get("store_dir") or os.path.join(tempfile.gettempdir(), "kllm-kv-tiers")
        self.capacity_bytes = cfg.store_capacity_bytes
        self.store: FilePageStore | None = None
        self.page_nbytes: int | None = None
        self.mem_pool_host: Any = None
        self.pages: PageBlocks | None = None  # the host pool's pages in place (zero-copy reads and writes)
        # HiCache calls the zero-copy interface (batch_get_v1 / batch_set_v1: pages read into and
        # written from the host pool in place) of a dynamic backend whose extra config says so; it
        # reads the flag from this config after constructing the backend. On unless set to 0.
        if storage_config.extra_config is not None and "interface_v1" not in storage_config.extra_config:
            storage_config.extra_config["interface_v1"] = 1

    # The namespace needs the host pool's dtype and page shape, so the store opens here.
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        sc = self.storage_config
        page = mem_pool_host.get_dummy_flat_data_page()
        self.page_nbytes = page.numel() * page.element_size()
        page_size = int(getattr(mem_pool_host, "page_size", 1))
        namespace = "|".join(str(x) for x in (
            "kllm-kv-v1", sc.model_name, f"tp{sc.tp_rank}/{sc.tp_size}", f"pp{sc.pp_rank}/{sc.pp_size}",
            f"cp{sc.attn_cp_rank}/{sc.attn_cp_size}", f"mla{int(sc.is_mla_model)}",
            getattr(mem_pool_host, "layout", "?"), str(page.dtype), f"page{page_size}", f"bytes{self.page_nbytes}",
        ))
        t = self.t
        t.events = TierEventLog(t.instance_id, page_size)
        self.store = FilePageStore(
            self.root, namespace, self.capacity_bytes, fsync=t.cfg.fsync, shared=True,
            on_transfer=self._on_transfer,
            on_store=lambda k: t.events.record("stored", "DISK", [k]) if t.events is not None else None,
            on_remove=lambda k: t.events.record("removed", "DISK", [k]) if t.events is not None else None,
        )
        t.store = self.store
        t.probe = self.store.exists
        t.ensure_fetch_policy(self.page_nbytes // max(1, page_size))
        self.pages = _page_blocks(mem_pool_host, self.page_nbytes)
        logger.info("kv_tiers L3 file store at %s (namespace %s, capacity %.1f GiB, %d pages adopted; "
                    "pages moved %s)", self.store.folder, namespace, self.capacity_bytes / (1 << 30),
                    len(self.store), "in place" if self.pages is not None else "through a staging copy")

    def _on_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        if direction == "read" and self.t.fetch is not None:
            self.t.fetch.observe_transfer("l3", nbytes, seconds)
        elif direction == "write":
            self.t.write_busy.add(seconds)

    def _fault_metrics(self, before: dict[str, int]) -> None:
        if self.store is None:
            return
        for reason, n in self.store.stats.faults.items():
            d = n - before.get(reason, 0)
            if d > 0:
                self.t._m_faults.labels(reason).inc(d)

    # -- reads ---------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.store is not None and self.store.exists(key)

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        if self.store is None:
            return 0
        t0 = time.perf_counter()
        try:
            return self._batch_exists(keys, extra_info)
        finally:
            self.t.spent("lookup", time.perf_counter() - t0)

    def _batch_exists(self, keys: List[str], extra_info: Any) -> int:
        assert self.store is not None
        n = self.store.prefix_hits(keys)
        self.t.note_lookup(keys, n, extends_cached_prefix(extra_info))
        return n

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        t0 = time.perf_counter()
        try:
            return self._batch_get(keys, target_locations)
        finally:
            self.t.spent("read", time.perf_counter() - t0)

    def _batch_get(self, keys: List[str], target_locations: Optional[Any]) -> List[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * len(keys)
        if self.store is None or target_locations is None:
            return out
        store = self.store

        def read(i: int, key: str) -> bool:
            target = target_locations[i]
            if target is None or not store.get_into(key, memoryview(target.view(torch.uint8).numpy()).cast("B")):
                return False
            out[i] = target
            return True

        self._read_prefix(keys, read)
        return out

    def _read_prefix(self, keys: List[str], read: Callable[[int, str], bool]) -> int:
        """Read pages in order with `read(i, key)` until the first that is missing (a prefix ends
        there); count hits, the miss and the store's faults; return the number read."""
        assert self.store is not None
        before = dict(self.store.stats.faults)
        hits = 0
        for i, key in enumerate(keys):
            if not read(i, key):
                self.t._m_pages.labels("miss").inc()
                break
            hits += 1
        if hits:
            self.t._m_pages.labels("hit").inc(hits)
        self._fault_metrics(before)
        return hits

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """HiCache's zero-copy read: pages straight into the host pool at `host_indices` (one
        `page_size` run per key); a prefix ends at its first missing page."""
        t0 = time.perf_counter()
        try:
            return self._batch_get_v1(keys, host_indices)
        finally:
            self.t.spent("read", time.perf_counter() - t0)

    def _batch_get_v1(self, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        out = [False] * len(keys)
        if self.store is None or self.mem_pool_host is None:
            return out
        starts = self._page_starts(host_indices, len(keys))
        hits = self._read_prefix(keys, lambda i, key: self._read_page(key, starts[i]))
        return [True] * hits + [False] * (len(keys) - hits)

    def _page_starts(self, host_indices: torch.Tensor, n: int) -> list[int]:
        page_size = int(getattr(self.mem_pool_host, "page_size", 1))
        return [int(x) for x in host_indices[: n * page_size : page_size].tolist()]

    def _read_page(self, key: str, index: int) -> bool:
        assert self.store is not None
        if self.pages is not None:
            return self.store.get_into(key, self.pages.blocks(index))
        page = self.mem_pool_host.get_dummy_flat_data_page()
        if not self.store.get_into(key, memoryview(page.view(torch.uint8).numpy()).cast("B")):
            return False
        self.mem_pool_host.set_from_flat_data_page(index, page)
        return True

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """HiCache's zero-copy write: pages written from the host pool in place."""
        if self.store is None or self.mem_pool_host is None:
            return [False] * len(keys)
        t0 = time.perf_counter()
        try:
            starts = self._page_starts(host_indices, len(keys))
            if self.pages is not None:
                pages = self.pages
                ok = self._batch_set(list(keys), lambda i: pages.blocks(starts[i]))
            else:
                pool = self.mem_pool_host
                ok = self._batch_set(list(keys), lambda i: [_byte_view(pool.get_data_page(starts[i]))])
            return [ok] * len(keys)
        finally:
            self.t.spent("write", time.perf_counter() - t0)

    # -- writes --------------------------------------------------------------------------

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if self.store is None or values is None:
            return False
        t0 = time.perf_counter()
        try:
            return self._batch_set(list(keys), lambda i: [_byte_view(values[i])])
        finally:
            self.t.spent("write", time.perf_counter() - t0)

    def _batch_set(self, keys: list[str], page: Callable[[int], list[memoryview]]) -> bool:
        """Write the admitted leading pages; `page(i)` gives key i's bytes (its blocks in order)."""
        assert self.store is not None
        fill = self.store.used_bytes / self.store.capacity_bytes
        busy = self.t.write_busy.fraction()
        # offer markers only matter when a page needs more than one sighting, and are left out
        # while the policy sees no reuse at all (dormant: a page then needs its sightings here)
        selective = self.t.persistence.threshold(fill, busy) > 1 and not self.t.persistence.dormant()
        if selective:
            fresh = [k for k in keys if not self.t.persistence.counter.count(k)]
            self.t.persistence.note_remote_sightings(fresh, self.store.note_offered(fresh))
        adm = self.t.persistence.admit(keys, fill, busy)
        skipped = len(keys) - adm.admitted
        logger.debug("kv_tiers write: %d of %d pages admitted (bar %d, fill %.2f)", adm.admitted, len(keys),
                     adm.threshold, fill)
        dormant = self.t.persistence.dormant()
        if skipped:
            # Not an error: HiCache would log a failed write. The page simply stays out of L3.
            self.t.count("pages_skipped", skipped)
            self.t._m_pages.labels("skipped").inc(skipped)
            if dormant and self.t.held.max_bytes:
                for i in range(adm.admitted, len(keys)):
                    self.t.held.hold(keys[i], b"".join(page(i)))  # a copy: the pool's page is reused
        before = dict(self.store.stats.faults)
        ok = True
        for i, key in enumerate(keys[: adm.admitted]):
            if not self.store.put(key, page(i)):
                ok = False
                break
            self.t.count("pages_admitted")
            self.t._m_pages.labels("written").inc()
            if selective:
                self.store.forget_offered(key)
        if not dormant and len(self.t.held):
            self._write_held()
        self._fault_metrics(before)
        return ok

    def _write_held(self) -> None:
        """Reuse is seen now: write the pages held back while the policy was dormant."""
        assert self.store is not None
        held = self.t.held.take_all()
        written = sum(1 for key, data in held if self.store.put(key, data))
        self.t.count("held_written", written)
        self.t._m_pages.labels("written").inc(written)
        logger.info("kv_tiers: reuse seen; wrote %d of %d pages held back while dormant", written, len(held))

    def clear(self) -> None:
        if self.store is not None:
            self.store.clear()

    def get_stats(self) -> Any:
        return None

    def close(self) -> None:
        pass


# -- hooks -----------------------------------------------------------------------------------


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _page_blocks(pool: Any, page_nbytes: int) -> PageBlocks | None:
    """The host pool's pages as in-place byte blocks, if its page views are views of one contiguous
    CPU buffer whose C order is the flat page's (MHA and MLA pools, every layout); else None
    (pages then go through a staging copy, as HiCache's generic path moves them)."""
    buffer = getattr(pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor) or not hasattr(pool, "get_data_page"):
        return None
    try:
        pages = PageBlocks(buffer, lambda i: pool.get_data_page(i, flat=False),
                           page_size=int(getattr(pool, "page_size", 0) or 0), tokens=int(getattr(pool, "size", 0) or 0))
        if pages.nbytes(0) != page_nbytes:
            return None
        return pages
    except Exception as exc:  # an unknown pool: the staging path is always right
        logger.info("kv_tiers: host pool pages not addressable in place (%s); using a staging copy", exc)
        return None


def _prefetch_operation(value: Any) -> Any:
    """The PrefetchOperation of an `ongoing_prefetch` entry: SGLang 0.5.23 keeps a NamedTuple whose
    `operation` is its fourth field, not its last (reading the last one, a dict of component
    transfers, counted every prefetch as 0 tokens in flight)."""
    return getattr(value, "operation", value)


def _inflight(cache: Any) -> tuple[int, int]:
    """Prefetches in flight and the host tokens they will take.

    An operation's `hash_value` holds the pages it will load only once the storage thread's hit
    query has run (`all_hash_values` is set then); before that it is empty. Counting such a
    prefetch as 0 let the gate start more prefetches than the admission hold's L2 budget keeps
    (on a loaded machine the span past the budget was refused a hold and evicted before its
    request ran). Until its query has run, an operation counts its whole page-aligned candidate
    span, an upper bound of what it can load."""
    ongoing = getattr(cache, "ongoing_prefetch", None) or {}
    page = int(getattr(cache, "page_size", 1) or 1)
    tokens = 0
    for value in list(ongoing.values()):
        op = _prefetch_operation(value)
        if getattr(op, "all_hash_values", None) is None and not getattr(op, "hash_value", None):
            tokens += len(getattr(op, "token_ids", None) or ()) // page * page
        else:
            tokens += len(getattr(op, "hash_value", None) or []) * page
    return len(ongoing), tokens


def _full_prefix_keys(cache: Any, node: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Pass the storage keys of the whole matched prefix as `prefix_keys`.

    SGLang 0.5.23 passes the keys of the anchor node's ancestors only (`get_prefix_hash_values`
    starts at the node's parent), so a lookup anchored on a node right under the root (a system
    prompt, a conversation's first turn) reaches the backend with no prefix keys at all, and the
    backend cannot tell a conversation's next turn from a one-off prompt. The anchor's own keys
    complete the chain (a write's prefix keys are its node's ancestors, which is complete there).
    """
    given = args[1] if len(args) >= 2 else kwargs.get("prefix_keys")
    if given is None:
        return args, kwargs  # hicache_storage_pass_prefix_keys is off
    try:
        own = list(cache.tree_core.get_hash_values(node) or [])
    except Exception:  # another tree core: leave SGLang's keys as they are
        return args, kwargs
    if not own or list(given[-len(own):]) == own:
        return args, kwargs
    full = list(given) + own
    if len(args) >= 2:
        return (args[0], full, *args[2:]), kwargs
    return args, {**kwargs, "prefix_keys": full}


def _page_keys(cache: Any, new_input_tokens: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               pages: int | None = None) -> list[str] | None:
    """The L3 storage keys a prefetch would look up (the first `pages`, or all), computed as
    HiCache's storage query does (`get_storage_hash_str` over the page-aligned tokens, chained on
    the anchor's hash, seeded by the request's namespace); None where it cannot be told (bigram
    keys, input shorter than a page)."""
    try:
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        page = int(getattr(cache, "page_size", 1))
        n = len(new_input_tokens) // page if pages is None else min(pages, len(new_input_tokens) // page)
        if n <= 0 or getattr(getattr(cache, "tree_core", None), "is_eagle", False):
            return None
        last_hash = args[0] if args else kwargs.get("last_hash")
        key = RadixKey(new_input_tokens[: n * page], extra_key=kwargs.get("extra_key"),
                       cache_salt=kwargs.get("cache_salt"))
        hashes = get_storage_hash_str(key, last_hash, page_size=page)
        return list(hashes) if isinstance(hashes, list) else [hashes]
    except Exception:  # another SGLang's key scheme: no probe, HiCache's lookup decides
        return None


def around_prefetch_from_storage(original: Callable[..., Any], self: Any, request: Any, last_host_node_id: Any,
                                 new_input_tokens: list[int], *args: Any, **kwargs: Any) -> Any:
    """Before HiCache starts an L3 prefetch for a queued request: with adaptive thresholds, set the
    prefetch threshold from the break-even length and apply the in-flight budget; with or without
    them, probe the first page and start no prefetch for a certain miss. A prefetch that starts
    leaves its token key for the admission hold."""
    t = tiers()
    started = request in (getattr(self, "ongoing_prefetch", None) or {})
    result = _prefetch(t, original, self, request, last_host_node_id, new_input_tokens, *args, **kwargs)
    if t.cfg.admission_hold and not started and request in (getattr(self, "ongoing_prefetch", None) or {}):
        _trim_oldest(t.prefetch_spans)
        # the tree keys are int64 arrays (SGLang's Rust tree core accepts nothing else)
        tokens = array("q", kwargs.get("matched_prefix_tokens") or ())
        tokens.extend(new_input_tokens)
        t.prefetch_spans[request] = (tokens, kwargs.get("extra_key"), kwargs.get("cache_salt"))
    return result


def _prefetch(t: _Tiers, original: Callable[..., Any], self: Any, request: Any, last_host_node_id: Any,
              new_input_tokens: list[int], *args: Any, **kwargs: Any) -> Any:
    adaptive = t.fetch is not None and t.cfg.adaptive_thresholds
    if not adaptive and t.probe is None:
        return original(self, request, last_host_node_id, new_input_tokens, *args, **kwargs)
    args, kwargs = _full_prefix_keys(self, last_host_node_id, args, kwargs)
    if adaptive:
        assert t.fetch is not None
        page = int(getattr(self, "page_size", 1))
        prefix = args[1] if len(args) >= 2 else kwargs.get("prefix_keys")
        context = len(prefix or ()) * page + len(new_input_tokens)  # the request's length, as far as told
        min_tokens = t.fetch.min_fetch_tokens("l3", context, busy=t.busy())
        t.note_threshold("l3", min_tokens, context)
        self.prefetch_threshold = max(page, _NO_FETCH_THRESHOLD if min_tokens == float("inf") else int(min_tokens))
    already = request in (getattr(self, "ongoing_prefetch", None) or {})
    if not adaptive and (already or len(new_input_tokens) < int(getattr(self, "prefetch_threshold", 0) or 0)):
        # HiCache's own threshold declines it (or it runs already): nothing to probe or track
        return original(self, request, last_host_node_id, new_input_tokens, *args, **kwargs)
    if not already:
        # the in-flight and L2 bounds apply with or without adaptive thresholds; without them
        # HiCache's own threshold (checked above) is the worth-it rule
        ops, tokens = _inflight(self)
        holds = _holds(t, self)
        d = t.gate.decide(len(new_input_tokens), min_tokens if adaptive else 0, ops, tokens,
                          explore=(lambda: t.fetch.explore_refused("l3")) if adaptive else None,
                          held_tokens=holds.tokens if holds is not None else 0,
                          l2_budget=holds.max_tokens if holds is not None else math.inf)
        if d.reason == "explore":  # admitted below the break-even length: let HiCache start it
            self.prefetch_threshold = page
            t.count("prefetch_explored")
        t._m_prefetch.labels(d.reason).inc()
        if not d.admit:
            t.count("prefetch_refused")
            # a prefetch refused for room is started later, in queue order, unless it would miss
            if d.deferred and holds is not None and not _probe_misses(t, self, new_input_tokens, args, kwargs):
                _defer(t, request)
            return None
        if _probe_misses(t, self, new_input_tokens, args, kwargs):
            return None
        t.count("prefetch_admitted")
    result = original(self, request, last_host_node_id, new_input_tokens, *args, **kwargs)
    if not already and request in (getattr(self, "ongoing_prefetch", None) or {}):
        t.prefetch_begun(request)
    return result


def _probe_misses(t: _Tiers, cache: Any, new_input_tokens: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> bool:
    """Probe the pages a prefetch needs; True = L3 cannot serve it (start no prefetch).

    Under HiCache's default "timeout" stop policy a request whose prefetch finds nothing still
    waits for it, about the timeout (1 s + 0.25 s per 1K tokens; 1.15-1.56 s measured), so a
    certain miss is not worth starting: the prefix is recomputed at once. A hit shorter than
    HiCache's `prefetch_threshold` (the break-even length under adaptive thresholds) is declined by
    HiCache only after its storage lookup, which the request waits for (2-3 ms per request at
    32-64 tokens, `benchmarks/kv_tiers/breakeven.py`): so the first page is probed and, when it
    is there, the last page the threshold needs. A prefetch re-issued for a known hit
    (`storage_hit_end`) is not probed again."""
    if t.probe is None or kwargs.get("storage_hit_end") is not None:
        return False
    keys = _page_keys(cache, new_input_tokens, args, kwargs)
    if not keys:
        return False
    page = int(getattr(cache, "page_size", 1) or 1)
    need = min(len(keys), max(1, -(-int(getattr(cache, "prefetch_threshold", page) or page) // page)))
    t0 = time.perf_counter()
    try:
        first = t.probe(keys[0])
        enough = first and (need == 1 or t.probe(keys[need - 1]))
    finally:
        t.spent("probe", time.perf_counter() - t0)
    if enough:
        return False
    outcome = "short" if first else "miss"
    t.count(f"prefetch_probe_{outcome}")
    t._m_prefetch.labels(f"l3_probe_{outcome}").inc()
    # the lookup HiCache would have made still tells selective persistence about reuse (a
    # continuation, or the short hit: at least its first page): without it a store left empty
    # while dormant would stay so
    prefix = args[1] if len(args) >= 2 else kwargs.get("prefix_keys")
    t.note_lookup(keys, int(first), bool(prefix))
    return True


def after_check_prefetch_progress(result: Any, self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """The scheduler asks whether a request's L3 prefetch is over before running it: False = the
    request waits for it (from the first such answer), True = over; record the delay it caused."""
    t = _tiers
    if t is None or not t.prefetch_started:
        return None
    if result is False:
        t.prefetch_blocking(request)
    elif result is True:
        loaded = int((getattr(self, "prefetch_loaded_tokens_by_reqid", None) or {}).get(request, 0) or 0)
        wait = t.prefetch_done(request, loaded)
        # only fetches that loaded something price a fetch: a miss that got past the probe (a page
        # evicted or still being written) is a race, counted in `prefetch_wait`, not a cost of hits
        if wait is not None and loaded > 0 and t.fetch is not None:
            t.fetch.observe_prefetch_wait(loaded * t.fetch.bytes_per_token, wait, busy=t.busy())
    return None


def after_handle_prefetch_result(result: Any, self: Any, operation: Any, *args: Any, **kwargs: Any) -> Any:
    """HiCache has just put a finished prefetch's span into the host tree (from the storage ack
    drain of each scheduler pass, or when the scheduler reaches the request), unlocked: hold it."""
    t = _tiers
    if t is None or not t.prefetch_spans:
        return None
    request = getattr(operation, "handle", None)
    span = t.prefetch_spans.pop(request, None)
    if span is not None:
        _hold_loaded_span(t, self, request, span)
    return None


def _hold_loaded_span(t: _Tiers, cache: Any, request: Any, span: tuple[array[int], Any, Any]) -> None:
    """Lock the span's last host node (which keeps the path above it) until the request is admitted
    or aborted, if the budget has room. Holds past their age are released here first."""
    loaded = int((getattr(cache, "prefetch_loaded_tokens_by_reqid", None) or {}).get(request, 0) or 0)
    holds = _holds(t, cache)
    if holds is None:
        return
    now = time.monotonic()
    for node, params in holds.expired(now):
        cache.dec_host_lock_ref(node, params)
        t.hold_event("expired", counted=True)
    if loaded <= 0 or request in holds:
        t.hold_event("nothing_loaded" if loaded <= 0 else "already_held")
        return
    if not holds.room_for(loaded):
        holds.refuse(loaded)
        t.hold_event("over_budget", counted=True)
        return
    try:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        tokens, extra_key, cache_salt = span
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra_key=extra_key, cache_salt=cache_salt)))
        node = match.last_host_node
        if node is None or cache.is_root(node):
            t.hold_event("no_node")
            return
        params = cache.inc_host_lock_ref(node).to_dec_params()
    except Exception:  # another tree core or SGLang: leave the span as stock does
        logger.warning("kv_tiers: could not hold an L3-loaded span until admission", exc_info=True)
        t.hold_event("failed")
        return
    holds.hold(request, (node, params), loaded, now)
    t.hold_event("held", counted=True)


def _holds(t: _Tiers, cache: Any) -> AdmissionHolds[tuple[Any, Any]] | None:
    """The admission holds, sized from the host pool at first use; None with holds off or no pool."""
    if t.holds is None and t.cfg.admission_hold:
        pool = getattr(getattr(cache, "cache_controller", None), "mem_pool_host", None)
        size = int(getattr(pool, "size", 0) or 0)
        if size > 0:
            t.holds = AdmissionHolds(int(size * t.cfg.admission_hold_fraction), t.cfg.admission_hold_max_s)
    return t.holds


def _defer(t: _Tiers, request: Any) -> None:
    _trim_oldest(t.deferred)
    t.deferred[request] = None
    t.count("prefetch_deferred")


def after_process_hicache_events(result: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """Each scheduler pass, after HiCache's own events and re-issues: start the deferred prefetches
    in waiting-queue order (the request nearest to running first) while the gate has room; the
    first one deferred again ends the walk. Room frees only when a prefetch ends or a hold is
    released, so a pass that finds the in-flight and held tokens as the last refusal left them
    walks nothing (a re-issue costs a prefix match and the probe's key hashing). Also notes the
    waiting queue's length: whether the next prefetch decisions and waits are a busy server's."""
    t = _tiers
    if t is None:
        return None
    queue = getattr(self, "waiting_queue", None) or ()
    t.waiting = len(queue)  # busy or idle, for the next decisions
    if not t.deferred:
        return None
    cache = self.tree_cache
    if _room_state(t, cache) == t.deferred_room:
        return None
    for req in list(queue):
        handle = getattr(req, "cache_request_handle", None)
        if handle not in t.deferred:
            continue
        del t.deferred[handle]
        t.count("prefetch_reissued")
        self._prefetch_kvcache(req)
        if handle in t.deferred:
            t.deferred_room = _room_state(t, cache)
            break
    return None


def _room_state(t: _Tiers, cache: Any) -> tuple[int, int, int]:
    ops, tokens = _inflight(cache)
    return ops, tokens, t.holds.tokens if t.holds is not None else 0


def _release_hold(cache: Any, request: Any, outcome: str) -> bool:
    t = _tiers
    if t is None:
        return False
    t.prefetch_spans.pop(request, None)
    t.deferred.pop(request, None)
    if t.holds is None:
        return False
    lock = t.holds.release(request, outcome)
    if lock is None:
        return False
    cache.dec_host_lock_ref(*lock)
    t.hold_event(outcome, counted=True)
    return True


def after_finish_storage_prefetch_admission(result: Any, self: Any, request: Any, fulfilled_tokens: int = 0,
                                            reason: Any = None, *args: Any, **kwargs: Any) -> Any:
    """The request is admitted (its L2 span loaded to the device, or recomputed): release its hold.
    A held span that still fell short is counted (it should not: the hold is what prevents it)."""
    if _release_hold(self, request, "admitted") and reason == "cache_admission_shortfall":
        assert _tiers is not None
        _tiers.hold_event("held_but_short")
    return None


def after_release_aborted_request(result: Any, self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """An aborted request's hold is released (and its pending span forgotten)."""
    _release_hold(self, request, "aborted")
    return None


def around_init_load_back(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """Set the L2 load-back threshold from the break-even length; measure L2->L1 loads."""
    t = tiers()
    if t.fetch is not None and t.cfg.adaptive_thresholds:
        m = t.fetch.min_fetch_tokens("l2")
        t.note_threshold("l2", m)
        if m == float("inf") and t.fetch.explore_refused("l2"):
            m = 0  # every explore_every-th refused load-back loads anyway: L2 is re-measured
            t.count("l2_explored")
        self.load_back_threshold = _NO_FETCH_THRESHOLD if m == float("inf") else int(m)
    t0 = time.perf_counter()
    result = original(self, *args, **kwargs)
    dt = time.perf_counter() - t0
    if isinstance(result, tuple) and result:
        loaded = result[0]
        if isinstance(loaded, int) and loaded > 0:
            t.count("l2_loaded_tokens", loaded)
            if t.fetch is not None:
                t.fetch.observe_transfer("l2", loaded * t.fetch.bytes_per_token, dt)
    return result


def around_run_batch(original: Callable[..., Any], self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    t0 = time.perf_counter()
    result = original(self, batch, *args, **kwargs)
    t = _tiers
    mode = getattr(batch, "forward_mode", None)
    if t is not None and t.fetch is not None and mode is not None and mode.is_extend():
        tokens = int(getattr(batch, "extend_num_tokens", 0) or 0)
        if tokens > 0:
            t.fetch.observe_prefill(tokens, time.perf_counter() - t0, _attention_pairs(batch))
    return result


def _attention_pairs(batch: Any) -> int | None:
    """Sum over the batch's requests of new tokens x sequence length (None where not told)."""
    ext, pre = getattr(batch, "extend_lens", None), getattr(batch, "prefix_lens", None)
    if not ext or not pre or len(ext) != len(pre):
        return None
    return sum(int(e) * (int(p) + int(e)) for e, p in zip(ext, pre))


def after_take_events(result: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    t = _tiers
    if t is None or t.events is None:
        return None
    pending = t.events.take()
    if not pending:
        return None
    recorder = getattr(self, "kv_events", None) or getattr(getattr(self, "tree_core", None), "kv_events", None)
    if not getattr(recorder, "enabled", False):
        return None  # events off: drop ours too, as SGLang drops its own
    return list(result or []) + [to_sglang_event(e) for e in pending]


# -- KV event wire types ---------------------------------------------------------------------

_wire_types: tuple[Any, Any] | None = None


def _wire() -> tuple[Any, Any]:
    global _wire_types
    if _wire_types is None:
        from typing import Optional as Opt

        from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

        class TierBlockStored(BlockStored, tag="BlockStored"):  # type: ignore[call-arg]
            instance_id: Opt[str] = None
            storage_keys: Opt[list[str]] = None

        class TierBlockRemoved(BlockRemoved, tag="BlockRemoved"):  # type: ignore[call-arg]
            instance_id: Opt[str] = None
            storage_keys: Opt[list[str]] = None

        _wire_types = (TierBlockStored, TierBlockRemoved)
    return _wire_types


def to_sglang_event(event: Any) -> Any:
    stored, removed = _wire()
    wire = event.to_wire()
    wire.pop("type")
    return (stored if event.kind == "stored" else removed)(**wire)


def register_publisher() -> Callable[[], bool]:
    """Register the `kllm_tiers` KV-event publisher (a ZMQ publisher that stamps the instance id)."""
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory, ZmqEventPublisher

    class KllmTierEventPublisher(ZmqEventPublisher):
        def publish(self, events: Any) -> None:
            iid = tiers().instance_id
            stored, removed = _wire()
            stamped = []
            for ev in events.events:
                if getattr(ev, "instance_id", "absent") is None:
                    ev.instance_id = iid
                elif type(ev).__name__ in ("BlockStored", "BlockRemoved"):
                    cls = stored if type(ev).__name__ == "BlockStored" else removed
                    fields = {f: getattr(ev, f) for f in ev.__struct_fields__}
                    ev = cls(**fields, instance_id=iid)
                stamped.append(ev)
            events.events = stamped
            super().publish(events)

    if "kllm_tiers" not in EventPublisherFactory._registry:
        EventPublisherFactory.register_publisher("kllm_tiers", KllmTierEventPublisher)
    return lambda: "kllm_tiers" in EventPublisherFactory._registry
