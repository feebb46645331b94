"""Layer: SGLang adapter of the kv_tiers plugin. The file L3 backend, `KllmFileStorage`.

A `HiCacheStorage` for HiCache's `dynamic` backend, backed by the core `FilePageStore` (checked,
bounded pages) and written through the core write path (`core/write_path.py`: selective
persistence, shared sightings, pages held while dormant). Select it with
    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name":"kllm_file",
        "module_path":"kllm_plugins.plugins.kv_tiers.sglang_adapter","class_name":"KllmFileStorage"}'
It works without the plugin enabled (defaults, or keys of the extra config), and takes the
plugin's options when it is.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any, Callable, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kllm_plugins.plugins.kv_tiers.core.file_store import FilePageStore, calibrate_reads
from kllm_plugins.plugins.kv_tiers.core.host_pages import PageBlocks, owned_copy
from kllm_plugins.plugins.kv_tiers.core.tier_events import TierEventLog
from kllm_plugins.plugins.kv_tiers.core.write_path import write_pages
from kllm_plugins.plugins.kv_tiers.sglang_adapter.state import tiers

logger = logging.getLogger("kllm.kv_tiers")


def extends_cached_prefix(extra_info: Any) -> bool:
    """Whether an L3 lookup is for a request that matched a prefix in L1/L2 (HiCache passes the
    matched prefix's keys when `hicache_storage_pass_prefix_keys` is set in the extra config)."""
    return bool(getattr(extra_info, "prefix_keys", None))


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
        fetch = t.ensure_fetch_policy(self.page_nbytes // max(1, page_size))
        self._calibrate(namespace, fetch)
        self.pages = _page_blocks(mem_pool_host, self.page_nbytes)
        logger.info("kv_tiers L3 file store at %s (namespace %s, capacity %.1f GiB, %d pages adopted; "
                    "pages moved %s)", self.store.folder, namespace, self.capacity_bytes / (1 << 30),
                    len(self.store), "in place" if self.pages is not None else "through a staging copy")

    def _calibrate(self, namespace: str, fetch: Any) -> None:
        """Measure L3 reads once at start (`l3_calibration_pages`), through a scratch store of the
        serving store's own class, so a store wrapped to be slower pays the same on these reads."""
        pages = self.t.cfg.l3_calibration_pages
        if not pages or self.store is None or self.page_nbytes is None:
            return
        cls = type(self.store)

        def scratch(ns: str) -> FilePageStore:
            return cls(self.root, f"{namespace}|{ns}", (pages + 1) * (self.page_nbytes + 4096), fsync=self.t.cfg.fsync,
                       shared=False, on_transfer=lambda d, n, s: self._on_transfer(d, n, s) if d == "read" else None)

        n = calibrate_reads(scratch, self.page_nbytes, pages)
        snap = fetch.snapshot()
        logger.info("kv_tiers: L3 reads measured at start over %d pages: %.2f GB/s, %.2f ms latency", n,
                    snap["l3_bandwidth_bytes_per_s"] / 1e9, snap["l3_latency_s"] * 1e3)

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
                self.t.meter.fault(reason, d)

    # -- reads ---------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.store is not None and self.store.exists(key)

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        if self.store is None:
            return 0
        t0 = time.perf_counter()
        try:
            n = self.store.prefix_hits(keys)
            self.t.note_lookup(keys, n, extends_cached_prefix(extra_info))
            return n
        finally:
            self.t.spent("lookup", time.perf_counter() - t0)

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
                self.t.meter.pages("miss")
                break
            hits += 1
        if hits:
            self.t.meter.pages("hit", hits)
        self._fault_metrics(before)
        return hits

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """HiCache's zero-copy read: pages straight into the host pool at `host_indices` (one
        `page_size` run per key); a prefix ends at its first missing page."""
        t0 = time.perf_counter()
        try:
            out = [False] * len(keys)
            if self.store is None or self.mem_pool_host is None:
                return out
            starts = self._page_starts(host_indices, len(keys))
            hits = self._read_prefix(keys, lambda i, key: self._read_page(key, starts[i]))
            return [True] * hits + [False] * (len(keys) - hits)
        finally:
            self.t.spent("read", time.perf_counter() - t0)

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

    # -- writes --------------------------------------------------------------------------

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
        """Offer `keys` through the shared write path; `page(i)` gives key i's bytes (its blocks in
        order). Whether every admitted page was written."""
        assert self.store is not None
        before = dict(self.store.stats.faults)
        try:
            return write_pages(self.t, _FileWriter(self.store), keys, _FileBatch(self.store, keys, page)).complete
        finally:
            self._fault_metrics(before)

    def clear(self) -> None:
        if self.store is not None:
            self.store.clear()

    def get_stats(self) -> Any:
        return None

    def close(self) -> None:
        pass


class _FileWriter:
    """The file store's side of the shared write path (`core/write_path.L3Writer`)."""

    def __init__(self, store: FilePageStore) -> None:
        self.store = store

    def fill(self) -> float:
        return self.store.used_bytes / self.store.capacity_bytes

    def note_offered(self, keys: list[str]) -> list[bool] | None:
        return self.store.note_offered(keys)

    def forget_offered(self, keys: list[str]) -> None:
        for key in keys:
            self.store.forget_offered(key)

    def put_held(self, key: str, data: bytes | memoryview) -> bool:
        return self.store.put(key, data)


class _FileBatch:
    """One write call's pages (`core/write_path.PageBatch`), written one by one until a failure."""

    def __init__(self, store: FilePageStore, keys: list[str], page: Callable[[int], list[memoryview]]) -> None:
        self.store, self.keys, self.page = store, keys, page

    def write(self, n: int) -> int:
        for i, key in enumerate(self.keys[:n]):
            if not self.store.put(key, self.page(i)):
                return i
        return n

    def copy(self, i: int) -> bytes | memoryview:
        return owned_copy(self.page(i))


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
