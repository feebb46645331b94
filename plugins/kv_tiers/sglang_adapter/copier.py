"""Layer: SGLang adapter of the kv_tiers plugin (hooks on HiCache's MHA host pool; imports no SGLang
module itself, it wraps the pool's methods). The staged L1<->L2 copier on SGLang's transfer path.

HiCache moves KV pages between the device pool and the host pool in
`MHATokenToKVPoolHost.backup_from_device_all_layer` (device to host, all layers) and
`load_to_device_per_layer` (host to device, called once per layer). On CUDA with the `direct` I/O
backend and the `page_first_direct` host layout (a host page is contiguous over all layers) these
run through the core `LayerListCopier`: gather the pages on the device, then one DMA per run of
consecutive host pages (and back), double-buffered on a copy stream. The load copies every layer
at layer 0 (as SGLang's Ascend path does) and the later per-layer calls only keep their order.

Everything else (CPU and other devices, other I/O backends or layouts, draft layers, pools with
KV scales) goes to SGLang's own code unchanged: on the CPU platform the hooks only look at the
device type and step aside.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

from kllm_plugins.plugins.kv_tiers.core.device_timings import PendingTimings
from kllm_plugins.plugins.kv_tiers.core.staged_copy import LayerListCopier, page_ids

logger = logging.getLogger("kllm.kv_tiers")

_lock = threading.Lock()
_copiers: dict[int, LayerListCopier] = {}
_backup_timings = PendingTimings()  # L1->L2 backups in flight on a GPU, timed by CUDA events
_announced: set[int] = set()


def _config() -> Any:
    from kllm_plugins import runtime

    return runtime.config_of("kv_tiers") if runtime.is_enabled("kv_tiers") else None


def _enabled() -> tuple[bool, int]:
    cfg = _config()
    return (bool(cfg.staged_copier), int(cfg.staged_copier_chunk_pages)) if cfg is not None else (False, 0)


def eligible(pool: Any, io_backend: str, device_type: str | None = None) -> bool:
    """Whether this pool's transfer can take the staged copier: a CUDA device pool, the `direct` I/O
    backend, the `page_first_direct` host layout, no draft layers, K and V of the same width, and
    the plain MHA pool (subclasses with KV scales or other packings keep their own code)."""
    try:
        dev = device_type or pool.device_k_buffers[0].device.type
        return (type(pool).__name__ == "MHATokenToKVPoolHost" and dev == "cuda" and io_backend == "direct" and pool.layout == "page_first_direct"
                and pool.layer_num == pool.target_layer_num and pool.page_size > 1
                and pool.head_dim == pool.v_head_dim)
    except (AttributeError, IndexError):
        return False


def copier_for(pool: Any, chunk_pages: int) -> LayerListCopier:
    """One copier (staging buffers) per host pool."""
    key = id(pool)
    with _lock:
        cp = _copiers.get(key)
        if cp is None:
            first = pool.device_k_buffers[0]
            per_layer = pool.page_size * first[0].numel()
            cp = LayerListCopier(first.device, len(pool.device_k_buffers), per_layer, first.dtype,
                                 chunk_pages=chunk_pages)
            _copiers[key] = cp
        if key not in _announced:
            _announced.add(key)
            logger.info("kv_tiers: staged L1<->L2 copier on HiCache's host pool (%d layers, %d-token pages, "
                        "%d-page chunks)", len(pool.device_k_buffers), pool.page_size, chunk_pages)
        return cp


def backup(pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, chunk_pages: int,
           sync: bool = False) -> int:
    """Device to host, all layers, K and V: what `backup_from_device_all_layer` does. Returns the
    host-side copies issued (runs of consecutive host pages, K and V)."""
    cp = copier_for(pool, chunk_pages)
    before = cp.copies["to_host"]
    dp, hl = cp.plan(page_ids(device_indices, pool.page_size), page_ids(host_indices, pool.page_size))
    cp.to_host(pool.device_k_buffers, pool.k_buffer, dp, hl, pool.page_size, sync=sync)
    cp.to_host(pool.device_v_buffers, pool.v_buffer, dp, hl, pool.page_size, sync=sync)
    return cp.copies["to_host"] - before


def load(pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, chunk_pages: int,
         sync: bool = False) -> None:
    """Host to device, all layers, K and V (done at the first layer's call)."""
    cp = copier_for(pool, chunk_pages)
    dp, hl = cp.plan(page_ids(device_indices, pool.page_size), page_ids(host_indices, pool.page_size))
    cp.to_device(pool.k_buffer, hl, pool.device_k_buffers, dp, pool.page_size, sync=sync)
    cp.to_device(pool.v_buffer, hl, pool.device_v_buffers, dp, pool.page_size, sync=sync)


def around_backup_from_device_all_layer(original: Callable[..., Any], self: Any, device_pool: Any,
                                        host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str,
                                        *args: Any, **kwargs: Any) -> Any:
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import state

    on, chunk = _enabled()
    t = state.current()  # nothing is timed before the process's tier state exists
    # SGLang's `direct` I/O backend hands the device indices over on the host (`move_indices`), so the
    # device pool says where the copy runs
    start = _cuda_event() if t is not None and (device_indices.is_cuda or _on_cuda(device_pool)) else None
    t0 = time.perf_counter()
    if not on or args or kwargs or not eligible(self, io_backend):
        # SGLang's own copy takes the direct backend's indices on the host (see around_move_indices)
        result = original(self, device_pool, host_indices, _on_host(device_indices, io_backend), io_backend,
                          *args, **kwargs)
    else:
        copies = backup(self, host_indices, device_indices, chunk)
        result = None  # SGLang's method returns nothing
        if t is not None:
            t.count("l2_backup_copies", copies)
    if t is not None:
        _note_backup(t, int(host_indices.numel()), time.perf_counter() - t0, start, self)
    return result


def _token_bytes(host_pool: Any) -> int:
    """Bytes of one token's KV in the host pool (every layer, K and V), 0 where the pool does not say."""
    try:
        return int(host_pool.get_size_per_token())
    except (AttributeError, TypeError, ValueError):
        return 0


def _on_cuda(device_pool: Any) -> bool:
    """Whether the device KV pool lives on a CUDA device (its `device`: "cuda", "cuda:0", a torch.device)."""
    return str(getattr(device_pool, "device", "")).startswith("cuda")


def _cuda_event() -> Any:
    """A timing event recorded now on the current stream (the one the backup's copies finish on)."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _note_backup(t: Any, tokens: int, seconds: float, start: Any, host_pool: Any = None) -> None:
    """L1->L2 write-through volume and time (on the scheduler thread): part of the per-request profile.
    `l2_backup` is the wall time of the call, which issues the copies without waiting for them; on a
    GPU (`start` given), `l2_backup_device` is the device time from the call's start to its copies'
    end, read from CUDA events once they have completed (at a later call: nothing waits for the device);
    with `l2_backup_device_bytes` (tokens times the pool's bytes per token, taken when the copy is
    issued) they give the copy bandwidth."""
    if start is not None:
        _backup_timings.add(start, _cuda_event(), (tokens, tokens * _token_bytes(host_pool)))
    t.count("l2_backup_tokens", tokens)
    t.spent("l2_backup", seconds)
    for device_s, (n, nbytes) in _backup_timings.ready():
        t.count("l2_backup_device_tokens", n)
        t.count("l2_backup_device_bytes", nbytes)
        t.spent("l2_backup_device", device_s)
        # per size class (a chunked prompt's backups alternate full chunks and short tails)
        size = backup_size_class(nbytes)
        t.count(f"l2_backup_calls_{size}", 1)
        t.count(f"l2_backup_bytes_{size}", nbytes)
        t.count(f"l2_backup_us_{size}", int(device_s * 1e6))


def backup_size_class(nbytes: int) -> str:
    """Size class of one backup for the per-class counters: under 64 MiB, under 512 MiB, larger."""
    return "small" if nbytes < 64 << 20 else "medium" if nbytes < 512 << 20 else "large"


def around_load_to_device_per_layer(original: Callable[..., Any], self: Any, device_pool: Any,
                                    host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
                                    io_backend: str, *args: Any, is_draft: bool = False, **kwargs: Any) -> Any:
    on, chunk = _enabled()
    if not on or args or kwargs or is_draft or not eligible(self, io_backend):
        return original(self, device_pool, host_indices, _on_host(device_indices, io_backend), layer_id,
                        io_backend, *args, is_draft=is_draft, **kwargs)
    if layer_id == 0:
        load(self, host_indices, device_indices, chunk)
    return None


def around_move_indices(original: Callable[..., Any], self: Any, host_indices: torch.Tensor,
                        device_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`HiCacheController.move_indices` with the `direct` I/O backend copies the device indices of a
    transfer to the host (`.cpu()`), on the scheduler's thread: a copy ordered after the forward pass
    in flight, so the scheduler waits for that pass before it can plan the next one, at every L2
    write and load. Where the staged copier takes the transfer (it reads page ids on the device)
    they stay on the GPU; SGLang's transfer engine already orders device-side indices on its
    streams (as for its `kernel` backend). Anything else goes to SGLang's own code."""
    if not device_indices.is_cuda or getattr(self, "io_backend", None) != "direct":
        return original(self, host_indices, device_indices)
    cfg = _config()
    pools = _host_pools(getattr(self, "mem_pool_host", None))
    if (cfg is None or not cfg.staged_copier or not cfg.device_indices_on_gpu or not pools
            or not all(eligible(p, "direct") for p in pools)):
        return original(self, host_indices, device_indices)
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import state

    t = state.current()
    if t is not None:
        t.count("l2_index_host_copies_skipped", 1)
    return host_indices, device_indices


def _host_pools(host: Any) -> list[Any]:
    """The host pools a controller moves indices for: those of a `HostPoolGroup` (what the
    UnifiedRadixCache's HybridCacheController holds, one entry per pool), else the pool itself."""
    entries = getattr(host, "entry_map", None)
    if isinstance(entries, dict):
        return [getattr(e, "host_pool", None) for e in entries.values()]
    return [] if host is None else [host]


def _on_host(device_indices: torch.Tensor, io_backend: str) -> torch.Tensor:
    """The direct backend's own copies take the device indices on the host (where
    around_move_indices left them on the GPU and the copier then stepped aside)."""
    return device_indices.cpu() if io_backend == "direct" and device_indices.is_cuda else device_indices
