"""Benchmark-only SGLang storage backends (imported by the server processes, not collected by pytest):
an emulated slow L3 medium, applied identically to stock HiCache's file backend and to the
kv_tiers plugin's file store.

There is no FUSE here and cgroup block-I/O throttling does not touch reads served from the page
cache, so the medium is emulated at the storage-backend layer: every page read and every existence
check sleeps `latency_ms + bytes / mb_s` (time.sleep: no CPU burnt, as a network store or a
throttled disk behaves). What is delayed, for both, is the same set of calls at the same layer:

- stock, `SlowHiCacheFile` (SGLang's `HiCacheFile` loaded through `--hicache-storage-backend dynamic`):
  `exists(key)` (HiCache's lookup calls it once per page until the first miss) and `get(key)` (one
  page read; a read that finds nothing pays the latency). The existence check that opens `set()`
  is not delayed: writes are not delayed for either setup.
- kv_tiers, `SlowKllmFileStorage` (the plugin's `KllmFileStorage`): its `FilePageStore.exists(key)`
  (the lookup's per-page check and the plugin's pre-prefetch probe) and each page read (inside the
  store's timed read, so the plugin's cost model sees the medium as it would see a real one; a
  refused read pays the latency).

Extra-config keys (both classes): `medium_latency_ms`, `medium_mb_s` (0: no bandwidth limit) and
`medium_stats_dir` (optional: each process keeps `<pid>.json` there with its calls, bytes and seconds
slept, so a benchmark can check that the delay applied).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from kllm_plugins.plugins.kv_tiers.core.file_store import FilePageStore
from kllm_plugins.plugins.kv_tiers.sglang_adapter import file_storage as _adapter
from kllm_plugins.plugins.kv_tiers.sglang_adapter.file_storage import KllmFileStorage

logger = logging.getLogger("kllm.kv_tiers.bench.slow_medium")


class Medium:
    """The emulated medium: a call moving `nbytes` costs `latency_s + nbytes / bytes_per_s`."""

    def __init__(self, latency_ms: float, mb_s: float, stats_dir: str = "", label: str = "") -> None:
        if latency_ms < 0 or mb_s < 0:
            raise ValueError(f"medium latency_ms and mb_s must be >= 0, got {latency_ms}, {mb_s}")
        self.latency_s = latency_ms / 1e3
        self.bytes_per_s = mb_s * 1e6
        self.label = label
        self.stats_path = os.path.join(stats_dir, f"{os.getpid()}.json") if stats_dir else ""
        if stats_dir:
            os.makedirs(stats_dir, exist_ok=True)
        self.counts: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()
        self._dump_lock = threading.Lock()
        self._seq = 0  # snapshots are numbered so that a late writer never overwrites a newer one
        self._dumped = 0

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, label: str) -> "Medium":
        e = extra or {}
        return cls(float(e.get("medium_latency_ms", 0.0)), float(e.get("medium_mb_s", 0.0)),
                   str(e.get("medium_stats_dir", "")), label)

    def cost_s(self, nbytes: int) -> float:
        return self.latency_s + (nbytes / self.bytes_per_s if self.bytes_per_s > 0 else 0.0)

    def charge(self, what: str, nbytes: int = 0) -> float:
        """Sleep for one call of kind `what` moving `nbytes`; the seconds slept."""
        s = self.cost_s(nbytes)
        if s > 0:
            time.sleep(s)
        with self._lock:
            c = self.counts.setdefault(what, {"calls": 0, "bytes": 0, "seconds": 0.0})
            c["calls"] += 1
            c["bytes"] += nbytes
            c["seconds"] += s
            # every call (a few per page at most, each already sleeping): the counts are never stale
            dump = bool(self.stats_path)
            if dump:
                self._seq += 1
                doc = {"seq": self._seq, "label": self.label, "pid": os.getpid(), "latency_ms": self.latency_s * 1e3,
                       "mb_s": self.bytes_per_s / 1e6, "counts": {k: dict(v) for k, v in self.counts.items()}}
        if dump:
            self._dump(doc)
        return s

    def _dump(self, doc: dict[str, Any]) -> None:
        with self._dump_lock:
            if doc["seq"] <= self._dumped:
                return
            self._dumped = doc["seq"]
            tmp = f"{self.stats_path}.tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump(doc, f)
                os.replace(tmp, self.stats_path)
            except OSError as exc:
                logger.warning("slow medium: stats not written (%s)", exc)


# -- stock: SGLang's file backend on the slow medium --------------------------------------------


class SlowHiCacheFile(HiCacheFile):
    """SGLang's `HiCacheFile`, unchanged except that existence checks and page reads pay the medium.
    The `dynamic` backend factory constructs it as `cls(storage_config, kwargs)`."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict[str, Any]] = None) -> None:
        super().__init__(storage_config)
        self.medium = Medium.from_extra(storage_config.extra_config, "hicache")
        self._in_set = threading.local()
        logger.info("slow medium on SGLang's file backend: %.1f ms + %.1f MB/s per call",
                    self.medium.latency_s * 1e3, self.medium.bytes_per_s / 1e6)

    def exists(self, key: str) -> bool:
        if not getattr(self._in_set, "on", False):
            self.medium.charge("exists")
        return super().exists(key)

    def get(self, key: str, target_location: torch.Tensor, target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        got = super().get(key, target_location, target_sizes)
        self.medium.charge("read" if got is not None else "read_miss",
                           target_location.numel() * target_location.element_size() if got is not None else 0)
        return got

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        self._in_set.on = True  # writes are not delayed (for either setup)
        try:
            return super().set(key, value, target_location, target_sizes)
        finally:
            self._in_set.on = False


# -- kv_tiers: the plugin's file store on the same medium ---------------------------------------


class SlowFilePageStore(FilePageStore):
    """`FilePageStore` whose existence checks and page reads pay the medium; a read's delay falls
    inside the store's own timing, so the plugin's cost model measures it (`medium` is a class
    attribute of the per-process subclass made by `SlowKllmFileStorage`)."""

    medium: Medium

    def exists(self, key: str) -> bool:
        self.medium.charge("exists")
        return super().exists(key)

    def _served(self, key: str, nbytes: int, seconds: float) -> None:
        slept = self.medium.charge("read", nbytes)
        super()._served(key, nbytes, seconds + slept)

    def _refused(self, key: str, exc: Exception) -> None:
        self.medium.charge("read_miss")
        super()._refused(key, exc)


class SlowKllmFileStorage(KllmFileStorage):
    """The plugin's `KllmFileStorage` over `SlowFilePageStore` (everything else unchanged)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict[str, Any]] = None) -> None:
        super().__init__(storage_config, kwargs)
        self.medium = Medium.from_extra(storage_config.extra_config, "kv_tiers")

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        # The plugin opens its store here and hands references to it around (the prefetch probe
        # keeps its bound `exists`), so the delayed class is substituted for the store's
        # construction itself: every reference the plugin takes is to the delayed store.
        slow = type("SlowFilePageStore", (SlowFilePageStore,), {"medium": self.medium})
        prev = _adapter.FilePageStore
        _adapter.FilePageStore = slow
        try:
            super().register_mem_pool_host(mem_pool_host)
        finally:
            _adapter.FilePageStore = prev
        if not isinstance(self.store, SlowFilePageStore):
            raise RuntimeError("kv_tiers' store was not opened through the slow medium")
        logger.info("slow medium on kv_tiers' file store: %.1f ms + %.1f MB/s per call",
                    self.medium.latency_s * 1e3, self.medium.bytes_per_s / 1e6)


__all__: List[str] = ["Medium", "SlowHiCacheFile", "SlowKllmFileStorage", "SlowFilePageStore"]
