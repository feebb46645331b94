"""Layer: plugin core (no SGLang import). The kv_tiers state of one process.

One `TierState` per SGLang process is shared by the L3 storage backend (file or Mooncake) and
the hooks on HiCache: the policies (selective persistence, fetch or recompute, the prefetch
gate, the admission holds, the pages held back while dormant), the counters and timings behind
`GET /kllm/stats`, and the per-request bookkeeping of L3 prefetches in flight. The adapter
translates SGLang's objects into calls on it; what it counts reaches Prometheus through a
`TierMeter` the adapter gives it.

Time comes from `clock` (monotonic seconds, injectable): prefetch waits, the age of holds and
the rate limit of threshold logs are all measured on it, so tests drive them without sleeping.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from array import array
from typing import Any, Callable

from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
from kllm_plugins.plugins.kv_tiers.core.admission_hold import AdmissionHolds
from kllm_plugins.plugins.kv_tiers.core.cost_model import CostPrior
from kllm_plugins.plugins.kv_tiers.core.fetch_policy import FetchOrRecompute
from kllm_plugins.plugins.kv_tiers.core.file_store import FilePageStore, StoreStats
from kllm_plugins.plugins.kv_tiers.core.held_pages import HeldPages
from kllm_plugins.plugins.kv_tiers.core.persistence import BusyMeter, PersistencePolicy
from kllm_plugins.plugins.kv_tiers.core.prefetch_gate import PrefetchGate
from kllm_plugins.plugins.kv_tiers.core.tier_events import TierEventLog

logger = logging.getLogger("kllm.kv_tiers")

NEVER_LOG_EVERY_S = 60.0  # a tier's worth-fetching turns are logged at most this often
MAX_TRACKED = 4096  # per-request maps keep at most this many entries (requests that never come back)

def trim_oldest(d: dict[Any, Any]) -> list[Any]:
    """Drop the older half of `d` once it holds more than `MAX_TRACKED` requests (aborted or
    otherwise never seen again); the keys dropped."""
    if len(d) <= MAX_TRACKED:
        return []
    dropped = list(d)[: MAX_TRACKED // 2]
    for key in dropped:
        del d[key]
    return dropped


class TierMeter:
    """Where the state's counts go besides its snapshot (the adapter's Prometheus counters);
    this base class drops them."""

    def pages(self, outcome: str, n: int = 1) -> None:
        """L3 pages by outcome: hit, miss, written, skipped."""

    def fault(self, reason: str, n: int = 1) -> None:
        """L3 pages (or calls) refused or failed, by reason."""

    def prefetch(self, reason: str) -> None:
        """One prefetch decision, by reason."""

    def hold(self, outcome: str) -> None:
        """One outcome of the admission hold."""


class TierState:
    """Per-process state shared by the storage backend and the hooks."""

    def __init__(self, cfg: KvTiersConfig, instance_id: str, meter: TierMeter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.instance_id = instance_id
        self.meter = meter or TierMeter()
        self.clock = clock
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
        # (l2_backup_device: the device time of the L1->L2 copies on a GPU, from CUDA events)
        self.path_s: dict[str, float] = {"lookup": 0.0, "read": 0.0, "write": 0.0, "l2_backup": 0.0,
                                         "l2_backup_device": 0.0, "probe": 0.0}
        self.path_calls: dict[str, int] = {"lookup": 0, "read": 0, "write": 0, "l2_backup": 0,
                                           "l2_backup_device": 0, "probe": 0}
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
        self.lock = threading.Lock()
        self._never: dict[str, bool] = {}
        self._never_logged: dict[str, float] = {}

    # -- policies built on first use --------------------------------------------------------

    def ensure_fetch_policy(self, bytes_per_token: int) -> FetchOrRecompute:
        with self.lock:
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

    def ensure_holds(self, host_pool_tokens: int) -> AdmissionHolds[tuple[Any, Any]] | None:
        """The admission holds, sized from the host pool at first use; None with holds off or no pool."""
        if self.holds is None and self.cfg.admission_hold and host_pool_tokens > 0:
            self.holds = AdmissionHolds(int(host_pool_tokens * self.cfg.admission_hold_fraction),
                                        self.cfg.admission_hold_max_s)
        return self.holds

    # -- counting ---------------------------------------------------------------------------

    def fault(self, reason: str, n: int = 1) -> None:
        """Count `n` L3 pages (or calls) refused or failed for `reason` (metric and snapshot)."""
        with self.lock:
            if self.backend_stats is not None:
                self.backend_stats.faults[reason] = self.backend_stats.faults.get(reason, 0) + n
        self.meter.fault(reason, n)

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def spent(self, what: str, seconds: float) -> None:
        with self.lock:
            self.path_s[what] += seconds
            self.path_calls[what] += 1

    def hold_event(self, outcome: str, counted: bool = False) -> None:
        """One outcome of the admission hold, in the metric and (unless `AdmissionHolds` counted it
        itself: held, admitted, aborted, expired, over_budget) in the snapshot."""
        if not counted and self.holds is not None:
            self.holds.note(outcome)
        self.meter.hold(outcome)

    def note_threshold(self, tier: str, min_tokens: float, request_tokens: int | None = None) -> None:
        """Log each time a tier turns from worth fetching to not (or back), at most once a minute:
        with a slow or overloaded store every hit is recomputed, and the log says so and why. "Not"
        = no hit is worth it, or none within the request (`request_tokens`): the break-even length
        depends on the request's length, so requests of mixed lengths can alternate."""
        never = min_tokens == float("inf") or (request_tokens is not None and min_tokens > request_tokens)
        now = self.clock()
        with self.lock:
            turned = never != bool(self._never.get(tier))  # a first answer counts only as "never"
            self._never[tier] = never
            if not turned or now - self._never_logged.get(tier, -math.inf) < NEVER_LOG_EVERY_S:
                return
            self._never_logged[tier] = now
        if self.fetch is None:
            return
        snap = self.fetch.snapshot()
        if never:
            self.meter.fault(f"{tier}_slower_than_recompute")
            logger.warning("kv_tiers: %s is slower than recomputing (measured %.3f GB/s, %.1f ms latency; prefill "
                           "%.0f tokens/s): its hits are recomputed until it speeds up", tier,
                           snap[f"{tier}_bandwidth_bytes_per_s"] / 1e9, snap[f"{tier}_latency_s"] * 1e3,
                           snap["prefill_tokens_per_s"])
        else:
            logger.info("kv_tiers: %s worth fetching again for hits of %d tokens and more", tier, int(min_tokens))

    # -- what lookups and the scheduler tell ------------------------------------------------

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

    def defer(self, request: Any) -> None:
        """A prefetch refused for room: re-issued in queue order once room frees."""
        trim_oldest(self.deferred)
        self.deferred[request] = None
        self.count("prefetch_deferred")

    # -- prefetch timings -------------------------------------------------------------------

    def prefetch_begun(self, request: Any) -> None:
        with self.lock:
            for key in trim_oldest(self.prefetch_started):  # aborted requests never complete
                self.prefetch_blocked.pop(key, None)
            self.prefetch_started.setdefault(request, self.clock())

    def prefetch_blocking(self, request: Any) -> None:
        """The scheduler would run the request now but waits for its prefetch."""
        with self.lock:
            if request in self.prefetch_started:
                self.prefetch_blocked.setdefault(request, self.clock())

    def prefetch_done(self, request: Any, loaded_tokens: int) -> float | None:
        """Record a finished L3 prefetch and how long it held its request up (0 when it finished while
        the request was still queued); those seconds, or None for a request not seen starting one."""
        with self.lock:
            t0 = self.prefetch_started.pop(request, None)
            blocked = self.prefetch_blocked.pop(request, None)
            if t0 is None:
                return None
            wait = self.clock() - blocked if blocked is not None else 0.0
            w = self.prefetch_wait
            w["calls"] += 1
            w["seconds"] += wait
            w["max_s"] = max(w["max_s"], wait)
            w["loaded_tokens"] += loaded_tokens
            if loaded_tokens <= 0:
                w["misses"] += 1
                w["miss_seconds"] += wait
        return wait

    # -- GET /kllm/stats ----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
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
            with self.lock:
                out["store"] = self.backend_stats.snapshot()
        out["backend"] = self.backend_name
        if self.fetch is not None:
            out["fetch_policy"] = self.fetch.snapshot()
        if self.holds is not None:
            out["admission_holds"] = self.holds.snapshot()
        return out
