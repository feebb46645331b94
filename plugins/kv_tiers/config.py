"""Layer: plugin config (no SGLang import). Options of the kv_tiers plugin."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvTiersConfig:
    store_dir: str = ""
    """Folder of the L3 file store ("" = <tmp>/kllm-kv-tiers). Instances sharing it share prefixes."""
    store_capacity_gb: float = 16.0
    """Upper bound of the L3 file store per rank, in GiB (least recently used pages are evicted)."""
    fsync: bool = False
    """fsync every page before publishing it (durable across power loss; slower writes)."""
    min_reuse: int = 2
    """Sightings a page needs before it is written to L3 (1 = write everything through, as stock)."""
    write_all_below_pressure: bool = True
    """Write every page while the store is below `fill_high` and the writer below `busy_high` (as
    stock); selective admission (`min_reuse` sightings) starts with the first kind of pressure."""
    reuse_window: int = 32
    """Write-all (above) holds only while one of the last `reuse_window` L3 lookups reused something
    (a cached prefix or an L3 hit) or a page came back; otherwise nothing is written before its
    `min_reuse`-th sighting (a workload without reuse writes nothing). 0: write-all always."""
    start_active: bool = True
    """A fresh instance assumes reuse (writes every page, as stock) until `reuse_window` lookups in a
    row show none; false: dormant from the start, nothing written before the first sign of reuse."""
    dormant_hold_mb: float = 64.0
    """While the policy is dormant (no reuse seen yet), keep up to this many MiB of the skipped pages
    in memory and write them once reuse is seen (a conversation's first turn, offered before its
    second showed reuse); nothing is written while no reuse is seen. 0: drop them."""
    fill_high: float = 0.9
    """Store fill fraction above which the reuse bar is raised (capacity pressure)."""
    busy_high: float = 0.5
    """Writer busy fraction above which the reuse bar is raised (bandwidth pressure)."""
    fetch_margin: float = 1.2
    """Fetch a hit only when fetching is this many times cheaper than recomputing it."""
    explore_every: int = 50
    """Every N-th refused fetch of a tier fetches anyway to re-measure it (0: never)."""
    prefetch_wait_by_load: bool = True
    """Learn the L3 prefetch round trip separately for a busy server (requests waiting) and an idle
    one, and price each fetch decision with the one for its state (off: one average over both)."""
    l3_read_gbps: float = 1.0
    """Prior L3 read bandwidth (GB/s) until measured."""
    l2_load_gbps: float = 10.0
    """Prior L2->L1 bandwidth (GB/s) until measured."""
    prefill_tokens_per_s: float = 5000.0
    """Prior prefill speed (tokens/s) until measured."""
    prefetch_max_inflight_ops: int = 4
    """Most L3 prefetches in flight at once."""
    prefetch_max_inflight_tokens: int = 8192
    """Most tokens of L3 prefetches in flight at once."""
    adaptive_thresholds: bool = True
    """Set HiCache's L3 prefetch and L2 load-back thresholds from the measured break-even lengths."""
    admission_hold: bool = True
    """Host-lock the span an L3 prefetch loaded into L2 from when HiCache inserts it until its request
    is admitted (or aborted), so that other work needing host memory does not evict it first and
    the request recompute what was read for it."""
    admission_hold_fraction: float = 0.5
    """Most of the host pool (as a fraction of its tokens) held that way at once; a span beyond it is
    left unheld, as stock leaves every span."""
    admission_hold_max_s: float = 120.0
    """A hold is released after this many seconds even if its request was never admitted."""
    instance_id: str = ""
    """Instance id carried by tier events ("" = <hostname>:<port or pid>)."""
    staged_copier: bool = True
    """On CUDA, move HiCache's L1<->L2 pages through the staged copier (direct I/O backend,
    page_first_direct host layout); other devices and layouts keep SGLang's own transfer."""
    staged_copier_chunk_pages: int = 256
    """Pages per staging buffer of the copier (two buffers per host pool)."""

    def __post_init__(self) -> None:
        if self.store_capacity_gb <= 0:
            raise ValueError(f"store_capacity_gb must be > 0, got {self.store_capacity_gb}")
        if self.min_reuse < 1:
            raise ValueError(f"min_reuse must be >= 1, got {self.min_reuse}")
        for name in ("fill_high", "busy_high"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        if self.fetch_margin < 1:
            raise ValueError(f"fetch_margin must be >= 1, got {self.fetch_margin}")
        if self.dormant_hold_mb < 0:
            raise ValueError(f"dormant_hold_mb must be >= 0, got {self.dormant_hold_mb}")
        if self.reuse_window < 0:
            raise ValueError(f"reuse_window must be >= 0, got {self.reuse_window}")
        if self.explore_every < 0:
            raise ValueError(f"explore_every must be >= 0, got {self.explore_every}")
        if not 0 <= self.admission_hold_fraction <= 1:
            raise ValueError(f"admission_hold_fraction must be in [0, 1], got {self.admission_hold_fraction}")
        for name in ("l3_read_gbps", "l2_load_gbps", "prefill_tokens_per_s", "admission_hold_max_s"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        for name in ("prefetch_max_inflight_ops", "prefetch_max_inflight_tokens", "staged_copier_chunk_pages"):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")

    @property
    def store_capacity_bytes(self) -> int:
        return int(self.store_capacity_gb * (1 << 30))
