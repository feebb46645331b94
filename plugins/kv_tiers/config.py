"""Layer: plugin config (no SGLang import). Options of the kv_tiers plugin."""
from __future__ import annotations

from dataclasses import dataclass

from kllm_plugins.spec import check_config, option


@dataclass(frozen=True)
class KvTiersConfig:
    store_dir: str = option("", "folder of the L3 file store ('' = <tmp>/kllm-kv-tiers)")
    """Folder of the L3 file store ("" = <tmp>/kllm-kv-tiers). Instances sharing it share prefixes."""
    store_capacity_gb: float = option(16.0, "L3 file store bound per rank (GiB)", gt=0)
    """Upper bound of the L3 file store per rank, in GiB (least recently used pages are evicted)."""
    fsync: bool = option(False, "fsync each L3 page before publishing it")
    """fsync every page before publishing it (durable across power loss; slower writes)."""
    min_reuse: int = option(2, "sightings before a page is written to L3 (1 = all)", ge=1)
    """Sightings a page needs before it is written to L3 (1 = write everything through, as stock)."""
    write_all_below_pressure: bool = option(
        True, "write every page while the store has room and bandwidth; select only under pressure")
    """Write every page while the store is below `fill_high` and the writer below `busy_high` (as
    stock); selective admission (`min_reuse` sightings) starts with the first kind of pressure."""
    reuse_window: int = option(
        32, "write-all only while one of the last N L3 lookups reused something (0: always)", ge=0)
    """Write-all (above) holds only while one of the last `reuse_window` L3 lookups reused something
    (a cached prefix or an L3 hit) or a page came back; otherwise nothing is written before its
    `min_reuse`-th sighting (a workload without reuse writes nothing). 0: write-all always."""
    start_active: bool = option(True, "assume reuse at start: write all until reuse_window lookups show none")
    """A fresh instance assumes reuse (writes every page, as stock) until `reuse_window` lookups in a
    row show none; false: dormant from the start, nothing written before the first sign of reuse."""
    dormant_hold_mb: float = option(
        64.0, "MiB of pages skipped before reuse is seen, written once it is (0: dropped)", ge=0)
    """While the policy is dormant (no reuse seen yet), keep up to this many MiB of the skipped pages
    in memory and write them once reuse is seen (a conversation's first turn, offered before its
    second showed reuse); nothing is written while no reuse is seen. 0: drop them."""
    fill_high: float = option(0.9, "store fill fraction that raises the reuse bar", gt=0, le=1)
    """Store fill fraction above which the reuse bar is raised (capacity pressure)."""
    busy_high: float = option(0.5, "writer busy fraction that raises the reuse bar", gt=0, le=1)
    """Writer busy fraction above which the reuse bar is raised (bandwidth pressure)."""
    fetch_margin: float = option(1.2, "fetch only when this many times cheaper than recompute", ge=1)
    """Fetch a hit only when fetching is this many times cheaper than recomputing it."""
    explore_every: int = option(50, "re-measure a refused tier every N decisions (0: never)", ge=0)
    """Every N-th refused fetch of a tier fetches anyway to re-measure it (0: never)."""
    prefetch_wait_by_load: bool = option(True, "learn the L3 prefetch round trip apart for a busy and an idle server")
    """Learn the L3 prefetch round trip separately for a busy server (requests waiting) and an idle
    one, and price each fetch decision with the one for its state (off: one average over both)."""
    l3_read_gbps: float = option(1.0, "prior L3 read bandwidth (GB/s) until measured", gt=0)
    """Prior L3 read bandwidth (GB/s) until measured."""
    l3_calibration_pages: int = option(
        4, "pages the file store writes and reads back at start to measure L3 (0: the prior until served reads)", ge=0)
    """Scratch pages the L3 file store writes and reads back when it opens, so that fetch-or-recompute
    starts from this store's measured reads instead of `l3_read_gbps` (0: off). Without it a store
    priced below the recompute is never read, and so never measured."""
    l2_load_gbps: float = option(10.0, "prior L2->L1 bandwidth (GB/s) until measured", gt=0)
    """Prior L2->L1 bandwidth (GB/s) until measured."""
    prefill_tokens_per_s: float = option(5000.0, "prior prefill speed until measured", gt=0)
    """Prior prefill speed (tokens/s) until measured."""
    prefetch_max_inflight_ops: int = option(4, "most L3 prefetches in flight", ge=1)
    """Most L3 prefetches in flight at once."""
    prefetch_max_inflight_tokens: int = option(8192, "most tokens of L3 prefetches in flight", ge=1)
    """Most tokens of L3 prefetches in flight at once."""
    adaptive_thresholds: bool = option(
        True, "set HiCache's prefetch / load-back thresholds from measured break-even lengths")
    """Set HiCache's L3 prefetch and L2 load-back thresholds from the measured break-even lengths."""
    admission_hold: bool = option(True, "host-lock each L3-loaded L2 span until its request is admitted")
    """Host-lock the span an L3 prefetch loaded into L2 from when HiCache inserts it until its request
    is admitted (or aborted), so that other work needing host memory does not evict it first and
    the request recompute what was read for it."""
    admission_hold_fraction: float = option(
        0.5, "most of the host pool held that way at once (fraction of its tokens)", ge=0, le=1)
    """Most of the host pool (as a fraction of its tokens) held that way at once; a span beyond it is
    left unheld, as stock leaves every span."""
    admission_hold_max_s: float = option(
        120.0, "release a hold after this many seconds if its request never runs", gt=0)
    """A hold is released after this many seconds even if its request was never admitted."""
    instance_id: str = option("", "instance id in tier events ('' = host:port)")
    """Instance id carried by tier events ("" = <hostname>:<port or pid>)."""
    staged_copier: bool = option(
        True, 'CUDA: HiCache L1<->L2 pages through the staged copier (direct, page_first_direct)')
    """On CUDA, move HiCache's L1<->L2 pages through the staged copier (direct I/O backend,
    page_first_direct host layout); other devices and layouts keep SGLang's own transfer."""
    staged_copier_chunk_pages: int = option(64, "pages per staging buffer of the copier", ge=1)
    """Pages per staging buffer of the copier (two buffers per host pool). Smaller chunks keep the
    link busy while a forward holds the SMs (inside a serving server on an H100, 64 beat 256:
    benchmarks/results/kv_tiers/gpu_no_reuse_one_server_chunks_h100.json)."""
    device_indices_on_gpu: bool = option(
        True, "with the staged copier: leave HiCache's device page indices on the GPU (no host sync)")
    """With the staged copier engaged, leave the device indices of HiCache's L1<->L2 transfers on
    the GPU: SGLang's `direct` I/O backend moves them to the host first (`HiCacheController.
    move_indices`), a copy that waits on the scheduler's thread for the forward pass in flight; the
    copier reads them on the device."""

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def store_capacity_bytes(self) -> int:
        return int(self.store_capacity_gb * (1 << 30))
