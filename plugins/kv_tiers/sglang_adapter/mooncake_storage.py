"""Layer: SGLang adapter of the kv_tiers plugin. The Mooncake L3 backend, `KllmMooncakeStorage`.

`KllmMooncakeStorage` is SGLang's own `MooncakeStore` (zero-copy `batch_*_v1` path, the
distributed store shared by instances) with the plugin's policies around it, selected with

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name":"kllm_mooncake","module_path":"kllm_plugins.plugins.kv_tiers.sglang_adapter",
        "class_name":"KllmMooncakeStorage","interface_v1":1, <Mooncake keys: master_server_address, ...>}'

What it adds to the stock backend:
- selective persistence through the write path the file store uses (`core/write_path.py`): only
  the leading run of pages the `PersistencePolicy` admits is written (a store that recently
  answered "full" counts as capacity pressure), and pages skipped while the policy is dormant are
  kept (`dormant_hold_mb`) and written, as K/V objects and a record, once reuse is seen;
- fetch or recompute: L3 reads are timed and feed the shared cost model, whose break-even length
  the prefetch hook turns into HiCache's prefetch threshold (as for the file store);
- checked pages: each page gets a small record (`page_format.encode_record`: namespace, key,
  length, CRC-32C) written after its K and V objects; a page whose record is missing, foreign
  (another model, layout, dtype or page shape) or does not match what was read is refused;
- faults never reach serving: a master unreachable at start or lost mid-run, a full store, a
  failed transfer are misses or refused writes, counted by reason
  (`kllm_kv_tiers_l3_faults_total{reason}`) and logged; the store is re-attached in the
  background once its master answers again (`close()` stops that thread);
- a slow or stalled master costs a miss, not a stall (`core/bounded_calls.py`): existence checks
  (the lookup, and the one that opens each write) wait at most `store_timeout_ms` (2000); a late
  one starts a slow episode during which lookups, reads and writes are skipped at once (misses,
  reason `store_slow`), logged once at its start and once at its end, the first check answered
  in time ending it. Zero-copy reads and writes cannot be abandoned (the store would write into
  or read from host pages HiCache has reused), so they run inline, are skipped during an
  episode and start one when they take longer than the timeout;
- a first-page probe (`probe`, extra keys `l3_probe`, default true, and `probe_timeout_ms`,
  default 50): the prefetch hook asks it whether the first page a prefetch would look up is in
  the store and starts no prefetch for a certain miss (under HiCache's default `timeout` policy
  a prefetch that finds nothing holds its request). It is a lookup of one page; the scheduler
  thread waits for it at most `probe_timeout_ms` (unanswered: the prefetch starts, and HiCache's
  bounded lookup decides), and during a slow episode it answers a miss at once;
- L3 events: `BlockStored` with medium `EXTERNAL` for every page written;
- shared sightings: an offer marker per page (a one-byte object in the same store,
  `core/shared_sightings.py`) lets a page's sighting on one instance count on every instance
  of the master, so a prefix seen once on each of two instances is written at the second
  (as the file store's `.seen/` markers do); a slow or failing master leaves them local.
Mooncake evicts on its own without telling clients, so no `BlockRemoved` events come from it.
"""
from __future__ import annotations

import ctypes
import logging
import socket
import struct
import threading
import time
import weakref
from typing import Any, Callable, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

from kllm_plugins.plugins.kv_tiers.core.bounded_calls import BoundedCalls, StoreSlow
from kllm_plugins.plugins.kv_tiers.core.file_store import StoreStats
from kllm_plugins.plugins.kv_tiers.core.host_pages import owned_copy
from kllm_plugins.plugins.kv_tiers.core.page_format import (
    PageError,
    PageFault,
    check_record,
    crc_of,
    decode_header,
    digest16,
    encode_record,
)
from kllm_plugins.plugins.kv_tiers.core.shared_sightings import SharedSightings
from kllm_plugins.plugins.kv_tiers.core.tier_events import TierEventLog
from kllm_plugins.plugins.kv_tiers.core.write_path import write_pages
from kllm_plugins.plugins.kv_tiers.sglang_adapter.file_storage import extends_cached_prefix
from kllm_plugins.plugins.kv_tiers.sglang_adapter.mooncake_markers import MooncakeMarkers, count_unshared, m_sightings
from kllm_plugins.plugins.kv_tiers.sglang_adapter.state import tiers

logger = logging.getLogger("kllm.kv_tiers")

_FULL_CODES = {-200}  # Mooncake NO_AVAILABLE_HANDLE: no segment has room for the object
_STORE_ERROR = -800  # Mooncake codes at or below: transfer (8xx) and RPC (9xx) failures, not misses
_FULL_MEMORY_S = 10.0  # a "full" answer counts as capacity pressure this long
_ERRORS_TO_DOWN = 3  # consecutive failed calls after which the store is treated as lost


class _Counted(RuntimeError):
    """A store call answered with error codes, already counted and logged."""


def master_reachable(address: str | None, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to the Mooncake master `host:port` opens (the Mooncake client
    itself retries for about 90 s before giving up, which would stall start-up)."""
    if not address or ":" not in address:
        return False
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class KllmMooncakeStorage(MooncakeStore):
    """SGLang's Mooncake HiCache backend with selective persistence, checked pages, measured reads
    and fault tolerance (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.t = tiers(extra)
        self.t.backend_name = "mooncake"
        if self.t.backend_stats is None:
            self.t.backend_stats = StoreStats()
        self.stats = self.t.backend_stats
        self.kllm_storage_config = storage_config
        self.verify = bool(extra.get("verify_pages", True))
        self.reconnect_s = float(extra.get("reconnect_s", 5.0))
        self.master_address = extra.get("master_server_address")
        self.ready = False
        self.pool: Any = None
        self.namespace_digest = b""
        self.page_nbytes = 0
        self._errors = 0
        self._full_at = 0.0
        self._layout: list[tuple[str, int]] | None = None  # see _object_layout
        self._reattach: threading.Thread | None = None
        self._stop = threading.Event()  # set by close() or when this backend is collected
        weakref.finalize(self, self._stop.set)
        self._state_lock = threading.Lock()
        self.bounded = BoundedCalls(float(extra.get("store_timeout_ms", 2000)) / 1e3, name="mooncake store")
        self.probe_enabled = bool(extra.get("l3_probe", True))
        self.probe_wait_s = float(extra.get("probe_timeout_ms", 50)) / 1e3
        self.sightings: SharedSightings | None = None
        if bool(extra.get("shared_sightings", True)):
            self.sightings = SharedSightings(MooncakeMarkers(self), float(extra.get("sightings_timeout_ms", 50)) / 1e3,
                                             on_unshared=count_unshared(self.t))
            weakref.finalize(self, self.sightings.close)  # its thread must not keep this client alive
        if self.master_address is not None and not master_reachable(self.master_address):
            self._down("down_at_start", f"master {self.master_address} unreachable")
            return
        try:
            MooncakeStore.__init__(self, storage_config, None)
        except Exception as exc:  # noqa: BLE001 - any setup failure leaves serving without L3
            self._down("down_at_start", f"setup failed: {exc}")
            return
        self.ready = True

    # -- state -----------------------------------------------------------------------------

    def _down(self, reason: str, detail: str) -> None:
        with self._state_lock:
            self.ready = False
            self.t.fault(reason)
            logger.warning("kv_tiers mooncake store %s (%s): L3 off, prefixes are recomputed; "
                           "re-attaching every %.1f s", reason.replace("_", " "), detail, self.reconnect_s)
            if not self._stop.is_set() and (self._reattach is None or not self._reattach.is_alive()):
                # the thread holds a weak reference only: it must not keep this client alive
                self._reattach = threading.Thread(target=_reattach_loop, name="kllm-kv-tiers-mooncake",
                                                  args=(weakref.ref(self), self._stop, self.reconnect_s), daemon=True)
                self._reattach.start()

    def _try_reattach(self) -> bool:
        if not master_reachable(self.master_address):
            return False
        try:
            MooncakeStore.__init__(self, self.kllm_storage_config, None)
            if self.pool is not None:
                MooncakeStore.register_mem_pool_host(self, self.pool)
        except Exception as exc:  # noqa: BLE001
            logger.warning("kv_tiers mooncake store: re-attach failed (%s)", str(exc))
            return False
        self._errors = 0
        self.ready = True
        logger.info("kv_tiers mooncake store re-attached to %s", self.master_address)
        return True

    def _skipped(self, op: str, exc: StoreSlow, n: int) -> None:
        """A call not made, or given up, because the store is slow (logged per episode by `bounded`).
        A late call to a master that no longer accepts connections means it is gone, not slow."""
        self.t.fault("store_slow", n)
        if exc.reason == "timeout" and self.ready and self.master_address is not None \
                and not master_reachable(self.master_address):
            self._down("store_lost", f"{op} unanswered, master {self.master_address} unreachable")

    def _call_failed(self, op: str, exc: BaseException | None, n: int) -> None:
        self.t.fault("store_error", n)
        self._errors += 1
        # the message, not the exception: a record kept by a handler must not hold this client
        logger.warning("kv_tiers mooncake store: %s of %d pages failed (%s); recomputing", op, n, str(exc or "error"))
        if self._errors >= _ERRORS_TO_DOWN and self.ready and not master_reachable(self.master_address):
            self._down("store_lost", f"master {self.master_address} unreachable")

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.pool = mem_pool_host
        page = int(getattr(mem_pool_host, "page_size", 1))
        sc = self.kllm_storage_config
        # get_ksize_per_token is the K half for MHA pools (K and V are separate objects)
        self.page_nbytes = int(mem_pool_host.get_ksize_per_token()) * page * (1 if sc.is_mla_model else 2)
        namespace = "|".join(str(x) for x in (
            "kllm-kv-mc-v1", sc.model_name, f"tp{sc.tp_rank}/{sc.tp_size}", f"pp{sc.pp_rank}/{sc.pp_size}",
            f"mla{int(sc.is_mla_model)}", getattr(mem_pool_host, "layout", "?"),
            str(getattr(mem_pool_host, "dtype", "?")), f"page{page}", f"bytes{self.page_nbytes}",
        ))
        self.namespace_digest = digest16(namespace)
        self.t.events = self.t.events or TierEventLog(self.t.instance_id, page)
        self.t.ensure_fetch_policy(max(1, self.page_nbytes // max(1, page)))
        if self.probe_enabled:
            self.t.probe = _weak_probe(self)
        if self.ready:
            MooncakeStore.register_mem_pool_host(self, mem_pool_host)
        else:
            HiCacheStorage.register_mem_pool_host(self, mem_pool_host)
        logger.info("kv_tiers L3 Mooncake store (master %s, %s, verify %s)", self.master_address,
                    "attached" if self.ready else "down", self.verify)

    # -- page records ------------------------------------------------------------------------

    def _record_keys(self, keys: List[str]) -> List[str]:
        return [f"{k}_{self.mha_suffix}_kllm" for k in self._tag_keys(keys)]

    def _page_crcs(self, host_indices: torch.Tensor, n: int) -> list[tuple[int, int]]:
        """(length, CRC-32C) of each page's bytes in the host pool, read through its zero-copy
        pointers (the same bytes Mooncake writes or has just read)."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices[: n * self.pool.page_size])
        per = len(ptrs) // max(1, n)
        return [crc_of([(ctypes.c_char * int(size)).from_address(int(ptr))
                        for ptr, size in zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per])])
                for i in range(n)]

    def _check_pages(self, keys: List[str], host_indices: torch.Tensor, ok: list[bool]) -> list[bool]:
        """Refuse (and cut the prefix at) the first page that does not match its record."""
        n = 0
        while n < len(ok) and ok[n]:
            n += 1
        if n == 0 or not self.verify:
            return ok
        records = self.store.get_batch(self._record_keys(keys[:n]))
        crcs = self._page_crcs(host_indices, n)
        for i in range(n):
            try:
                if not records[i]:
                    raise PageError(PageFault.MISSING, "no page record")
                check_record(decode_header(records[i]), self.namespace_digest, keys[i], *crcs[i])
            except (PageError, struct.error) as exc:
                fault = exc.fault.value if isinstance(exc, PageError) else PageFault.CORRUPT.value
                self.t.fault(fault)
                self.stats.misses += 1
                logger.warning("kv_tiers mooncake store: page %s refused (%s); recomputing it", keys[i], exc)
                return [True] * i + [False] * (len(ok) - i)
        return ok

    # -- reads -------------------------------------------------------------------------------

    def _lookup(self, keys: List[str], extra_info: Any) -> int:
        n = MooncakeStore.batch_exists(self, keys, extra_info)
        if self.verify and n:
            have = self.store.batch_is_exist(self._record_keys(keys[:n]))
            n = next((i for i, h in enumerate(have) if h != 1), n)
        return n

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        if not self.ready:
            return 0
        try:
            n = self.bounded.call("lookup", lambda: self._lookup(keys, extra_info))
        except StoreSlow as exc:
            self._skipped("lookup", exc, len(keys))
            return 0
        except _Counted:
            return 0
        except Exception as exc:  # noqa: BLE001
            self._call_failed("lookup", exc, len(keys))
            return 0
        self.t.persistence.note_request(bool(n) or extends_cached_prefix(extra_info))
        if n < len(keys):
            self.t.persistence.note_lookup_miss(keys[n:])
            if n or extends_cached_prefix(extra_info):
                self.t.persistence.note_continuation(keys[n:])
        return n

    def probe(self, key: str) -> bool:
        """Whether the page under HiCache storage key `key` may be in the store; False = a certain
        miss (the prefetch hook then starts no prefetch). The check is the one a lookup of the page
        makes (`_lookup`: its K and V objects, keyed by `MooncakeStore.batch_exists`, and its
        record), run by `bounded.try_call`: the caller (the scheduler thread) waits at most
        `probe_timeout_ms` (50). Not answered by then: True, HiCache's lookup decides on its own
        thread, bounded by `store_timeout_ms` (a stall is judged there, not here). During a slow
        episode: False at once, counted `store_slow`. Store down or failing: False (failures
        counted as for lookups)."""
        if not self.ready:
            return False
        try:
            return self.bounded.try_call("probe", lambda: self._lookup([key], None), self.probe_wait_s) == 1
        except StoreSlow as exc:
            if exc.reason == "pending":
                self.t.count("probe_unanswered")
                return True
            self._skipped("lookup", exc, 1)
        except _Counted:
            pass
        except Exception as exc:  # noqa: BLE001
            self._call_failed("lookup", exc, 1)
        return False

    def _batch_exist(self, key_strs: List[str]) -> List[int]:
        # bounded: a lookup's own check runs inside its bounded call; a write's opens the write
        codes = self.bounded.call("lookup", lambda: MooncakeStore._batch_exist(self, key_strs))
        bad = [c for c in codes if c <= _STORE_ERROR]
        if bad:
            self._call_failed("lookup", RuntimeError(f"codes {sorted(set(bad))}"), len(key_strs))
            # raised, not zeros: an error answer must not end a slow episode as an answer in time
            raise _Counted(f"codes {sorted(set(bad))}")
        self._errors = 0
        return codes

    def _get_batch_zero_copy_impl(self, key_strs: List[str], buffer_ptrs: List[Any],
                                  buffer_sizes: List[Any]) -> List[int]:
        codes = MooncakeStore._get_batch_zero_copy_impl(self, key_strs, buffer_ptrs, buffer_sizes)
        bad = [c for c in codes if c <= _STORE_ERROR]
        if bad:
            self._call_failed("read", RuntimeError(f"codes {sorted(set(bad))}"), len(key_strs))
        return codes

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        if not self.ready:
            return [False] * len(keys)
        if not self.bounded.admit("read"):
            self._skipped("read", StoreSlow("slow", "read"), len(keys))
            return [False] * len(keys)
        t0 = time.perf_counter()
        try:
            ok = list(MooncakeStore.batch_get_v1(self, keys, host_indices, extra_info))
            dt = time.perf_counter() - t0
            if not all(ok) and self.ready and self._errors == 0:
                # evicted since the lookup, or an object of another size (layout) under this key
                self.t.fault("read_failed")
                logger.warning("kv_tiers mooncake store: read of page %s failed; recomputing from there",
                               keys[ok.index(False)])
            ok = self._check_pages(keys, host_indices, ok)
        except Exception as exc:  # noqa: BLE001
            self._call_failed("read", exc, len(keys))
            return [False] * len(keys)
        finally:
            self.bounded.observe("read", time.perf_counter() - t0)
        hits = next((i for i, v in enumerate(ok) if not v), len(ok))
        with self.t.lock:
            self.stats.gets += len(keys)
            self.stats.hits += hits
            self.stats.hit_bytes += hits * self.page_nbytes
            self.stats.misses += len(keys) - hits
        if hits:
            self._errors = 0
            self.t.meter.pages("hit", hits)
            if self.t.fetch is not None:
                self.t.fetch.observe_transfer("l3", hits * self.page_nbytes, dt)
        if hits < len(keys):
            self.t.meter.pages("miss", len(keys) - hits)
        return ok

    # -- writes ------------------------------------------------------------------------------

    def _put_batch_zero_copy_impl(self, key_strs: List[str], buffer_ptrs: List[Any], buffer_sizes: List[Any],
                                  group_ids: Optional[List[str]] = None,
                                  session_ids: Optional[List[str]] = None) -> List[int]:
        codes = MooncakeStore._put_batch_zero_copy_impl(self, key_strs, buffer_ptrs, buffer_sizes, group_ids,
                                                        session_ids)
        bad = [c for c in codes if c != 0]
        if bad:
            full = sum(1 for c in bad if c in _FULL_CODES)
            if full:
                self._full_at = time.monotonic()
                self.t.fault("full", full)
                logger.warning("kv_tiers mooncake store full: %d objects not written (pages stay out of L3)", full)
            if len(bad) > full:
                self._call_failed("write", RuntimeError(f"codes {sorted(set(bad))}"), len(bad) - full)
        return codes

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        if not self.ready:
            self.t.fault("store_down", len(keys))
            return [False] * len(keys)
        if not self.bounded.admit("write"):
            self._skipped("write", StoreSlow("slow", "write"), len(keys))
            return [False] * len(keys)
        batch = _MooncakeBatch(self, list(keys), host_indices, extra_info)
        try:
            out = write_pages(self.t, _MooncakeWriter(self), list(keys), batch)
        except StoreSlow as exc:  # a check or the records were late: pages without records are never served
            self._skipped("write", exc, len(keys))
            return [False] * len(keys)
        except _Counted:
            return [False] * len(keys)
        except Exception as exc:  # noqa: BLE001
            self._call_failed("write", exc, batch.attempted)
            return [False] * len(keys)
        return batch.ok + [True] * out.skipped  # skipped pages: not written by choice, not a failure

    def _put_records(self, keys: list[str], crcs: list[tuple[int, int]]) -> bool:
        """Write the records of pages just written (bounded: checks, and records held by the call
        itself, are safe to abandon); whether every page has one."""
        recs = [encode_record(self.namespace_digest, k, n, c) for k, (n, c) in zip(keys, crcs)]
        rkeys = self._record_keys(keys)
        have = self.bounded.call("write", lambda: self.store.batch_is_exist(rkeys))
        todo = [(k, r) for k, r, h in zip(rkeys, recs, have) if h != 1]
        return not todo or self.bounded.call("write", lambda: self.store.put_batch(
            [k for k, _ in todo], [r for _, r in todo])) == 0

    def _written(self, keys: list[str], seconds: float) -> None:
        """Pages (with their records) are in the store: stats, timings and L3 events."""
        self.bounded.observe("write", seconds)
        self.t.write_busy.add(seconds)
        if not keys:
            return
        self._errors = 0
        with self.t.lock:
            self.stats.puts += len(keys)
            self.stats.put_bytes += len(keys) * self.page_nbytes
        if self.t.events is not None:
            self.t.events.record("stored", "EXTERNAL", list(keys))

    def _object_layout(self, page_indices: torch.Tensor) -> list[tuple[str, int]]:
        """Suffix and size of each object a page is stored as (K and V, or the MLA latent), learned
        from the key scheme of `MooncakeStore` on one page of the pool; [] where a page is not a
        flat list of objects (split heads): pages held while dormant are then dropped."""
        if self._layout is None:
            probe = "\x00"
            key_strs, _, sizes = self._batch_preprocess([probe], page_indices)
            flat = all(isinstance(n, int) for n in sizes) and all(k.startswith(probe) for k in key_strs)
            self._layout = [(k[len(probe):], int(n)) for k, n in zip(key_strs, sizes)] if flat else []
        return self._layout

    def _put_held(self, key: str, data: bytes | memoryview) -> bool:
        """Write a page kept in memory while dormant: its objects (as the zero-copy path names and
        sizes them, each as bytes for the store's `put_batch`) and its record."""
        layout = self._layout or []
        if not layout or len(data) != sum(n for _, n in layout) or not self.ready or not self.bounded.admit("write"):
            return False
        tagged = self._tag_keys([key])[0]
        okeys, parts, at = [], [], 0
        for suffix, n in layout:
            okeys.append(tagged + suffix)
            parts.append(bytes(data[at:at + n]))
            at += n
        t0 = time.perf_counter()
        try:
            have = self.bounded.call("write", lambda: self.store.batch_is_exist(okeys))
            todo = [(k, v) for k, v, h in zip(okeys, parts, have) if h != 1]
            if todo and self.bounded.call("write", lambda: self.store.put_batch(
                    [k for k, _ in todo], [v for _, v in todo])) != 0:
                self._call_failed("write", RuntimeError("held page not written"), 1)
                return False
            if self.verify and not self._put_records([key], [crc_of(parts)]):
                return False
        except StoreSlow as exc:
            self._skipped("write", exc, 1)
            return False
        except _Counted:
            return False
        except Exception as exc:  # noqa: BLE001
            self._call_failed("write", exc, 1)
            return False
        self._written([key], time.perf_counter() - t0)
        return True

    def clear(self) -> None:
        if self.ready:
            try:
                self.bounded.call("clear", lambda: MooncakeStore.clear(self))
            except StoreSlow:
                logger.warning("kv_tiers mooncake store: L3 not cleared (the store is slow)")

    def close(self) -> None:
        """Stop the background threads and release the Mooncake client now (not at exit)."""
        self._stop.set()
        self.ready = False
        if self.sightings is not None:
            self.sightings.close()
        MooncakeStore.close(self)
        store, self.store = getattr(self, "store", None), None
        # a client still inside a late call is left to its destructor, not closed under it
        if store is not None and not self.bounded.pending:
            try:
                store.close()
            except Exception as exc:  # noqa: BLE001 - closing a client of a lost master
                logger.debug("kv_tiers mooncake store: close failed (%s)", exc)

    def get_stats(self) -> Any:
        return MooncakeStore.get_stats(self) if self.ready else None


class _MooncakeWriter:
    """The Mooncake store's side of the shared write path (`core/write_path.L3Writer`)."""

    def __init__(self, backend: KllmMooncakeStorage) -> None:
        self.backend = backend

    def fill(self) -> float:
        # Mooncake tells no fill: a store that recently answered "full" counts as full
        return 1.0 if time.monotonic() - self.backend._full_at < _FULL_MEMORY_S else 0.0

    def note_offered(self, keys: list[str]) -> list[bool] | None:
        b = self.backend
        if b.sightings is None:
            return None
        seen = b.sightings.note_offered(keys)
        if any(seen):
            b.t.count("sightings_shared", sum(seen))
            m_sightings().labels("seen_elsewhere").inc(sum(seen))
        return seen

    def forget_offered(self, keys: list[str]) -> None:
        if self.backend.sightings is not None:
            self.backend.sightings.forget_offered(list(keys))

    def put_held(self, key: str, data: bytes | memoryview) -> bool:
        return self.backend._put_held(key, data)


class _MooncakeBatch:
    """One `batch_set_v1` call's pages in the host pool (`core/write_path.PageBatch`)."""

    def __init__(self, backend: KllmMooncakeStorage, keys: list[str], host_indices: torch.Tensor,
                 extra_info: Any) -> None:
        self.backend, self.keys, self.host_indices, self.extra_info = backend, keys, host_indices, extra_info
        self.ok: list[bool] = []  # the admitted pages' results
        self.attempted = 0

    def write(self, n: int) -> int:
        b, page = self.backend, self.backend.pool.page_size
        self.attempted = n
        t0 = time.perf_counter()
        try:
            ok = list(MooncakeStore.batch_set_v1(b, self.keys[:n], self.host_indices[: n * page], self.extra_info))
            written = next((i for i, v in enumerate(ok) if not v), n)
            if written and b.verify and not b._put_records(self.keys[:written], b._page_crcs(self.host_indices, written)):
                written = 0  # pages without records are never served; report them unwritten
                ok = [False] * n
        except (StoreSlow, _Counted):
            raise
        except Exception:
            b.bounded.observe("write", time.perf_counter() - t0)
            raise
        self.ok = ok
        b._written(self.keys[:written], time.perf_counter() - t0)
        return written

    def copy(self, i: int) -> bytes | memoryview | None:
        b, page = self.backend, self.backend.pool.page_size
        indices = self.host_indices[i * page:(i + 1) * page]
        if not b._object_layout(indices):
            return None
        ptrs, sizes = b.pool.get_page_buffer_meta(indices)
        return owned_copy([memoryview((ctypes.c_char * int(n)).from_address(int(p))).cast("B")
                           for p, n in zip(ptrs, sizes)])


def _reattach_loop(ref: "weakref.ref[KllmMooncakeStorage]", stop: threading.Event, every_s: float) -> None:
    """Re-attach the backend behind `ref` once its master answers; ends when it is attached,
    closed or collected."""
    while not stop.wait(every_s):
        backend = ref()
        if backend is None or backend.ready or backend._try_reattach():
            return
        del backend


def _weak_probe(backend: KllmMooncakeStorage) -> Callable[[str], bool]:
    """The backend's probe for the process-wide hook state, holding the backend weakly (the state
    outlives a closed or dropped client)."""
    ref = weakref.ref(backend)

    def probe(key: str) -> bool:
        b = ref()
        return b is not None and b.probe(key)

    return probe
