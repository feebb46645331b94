"""kv_tiers' HiCache storage backend against SGLang's real HiCacheStorage API (no server).

The host pool is a stand-in exposing what the backend reads (`get_dummy_flat_data_page`,
`page_size`, `layout`); keys, values and call shapes are HiCache's generic page path
(`batch_exists` / `batch_get` into flat page buffers / `batch_set` of page tensors).
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.sglang

PAGE_ELEMS = 2 * 4 * 16 * 2 * 8  # kv x layers x page tokens x heads x head_dim


class _HostPool:
    page_size = 16
    layout = "layer_first"

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(PAGE_ELEMS, dtype=torch.bfloat16)


def _config(model: str = "tiny-llama", extra: dict[str, Any] | None = None) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name=model, extra_config=extra,
    )


@pytest.fixture()
def backend_factory(tmp_path, monkeypatch):
    from kllm_plugins.plugins.kv_tiers import sglang_adapter
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import state

    def make(model: str = "tiny-llama", pool: Any = None, **extra: Any) -> Any:
        monkeypatch.setattr(state, "_tiers", None)  # fresh per-process state
        cfg = {"backend_name": "kllm_file", "module_path": sglang_adapter.__name__,
               "class_name": "KllmFileStorage", "store_dir": str(tmp_path),
               # most tests pin down the selective rule itself; the default (write everything while
               # the store has room) has its own test
               "write_all_below_pressure": False,
               # and the reuse-window tests start dormant; the assumed-reuse start has its own test
               "start_active": False,
               # and the cost model starts from the priors each test sets; the start-up L3
               # calibration has its own test
               "l3_calibration_pages": 0, **extra}
        b = sglang_adapter.KllmFileStorage(_config(model, cfg), {})
        b.register_mem_pool_host(pool if pool is not None else _HostPool())
        return b

    return make


def _pages(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGE_ELEMS, generator=g).to(torch.bfloat16) for _ in range(n)]


def _keys(n: int, tag: str) -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


def test_dynamic_factory_builds_the_backend(tmp_path) -> None:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kllm_plugins.plugins.kv_tiers.sglang_adapter import KllmFileStorage

    extra = {"backend_name": "kllm_file", "module_path": "kllm_plugins.plugins.kv_tiers.sglang_adapter",
             "class_name": "KllmFileStorage", "store_dir": str(tmp_path)}
    b = StorageBackendFactory.create_backend("dynamic", _config(extra=extra), _HostPool())
    assert isinstance(b, KllmFileStorage)


def test_second_offer_is_written_and_read_back(backend_factory) -> None:
    b = backend_factory(min_reuse=2)
    keys, pages = _keys(4, "a"), _pages(4, 0)
    assert b.batch_set(keys, pages)  # first offer: skipped, not an error
    assert b.batch_exists(keys) == 0
    assert b.batch_set(keys, pages)  # second offer: written
    assert b.batch_exists(keys) == 4
    dst = [torch.empty(PAGE_ELEMS, dtype=torch.bfloat16) for _ in keys]
    got = b.batch_get(keys, dst)
    assert all(g is d for g, d in zip(got, dst))
    for d, p in zip(dst, pages):
        assert torch.equal(d, p)
    snap = b.t.snapshot()
    assert snap["pages_skipped"] == 4 and snap["pages_admitted"] == 4


def test_corrupt_page_is_a_miss_and_ends_the_prefix(backend_factory) -> None:
    b = backend_factory(min_reuse=1)
    keys, pages = _keys(3, "c"), _pages(3, 1)
    assert b.batch_set(keys, pages)
    path = b.store.path_of(keys[1])
    raw = bytearray(open(path, "rb").read())
    raw[-3] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    dst = [torch.empty(PAGE_ELEMS, dtype=torch.bfloat16) for _ in keys]
    got = b.batch_get(keys, dst)
    assert got[0] is dst[0] and got[1] is None and got[2] is None
    assert b.store.stats.faults["corrupt"] == 1
    assert b.batch_exists(keys) == 1  # the bad page is gone


def test_pages_of_another_model_are_not_served(backend_factory, tmp_path) -> None:
    a = backend_factory("model-a", min_reuse=1)
    keys, pages = _keys(2, "m"), _pages(2, 2)
    assert a.batch_set(keys, pages)
    b = backend_factory("model-b", min_reuse=1)
    assert b.store.folder != a.store.folder
    assert b.batch_exists(keys) == 0
    # even when copied where model-b looks, the header names model-a's namespace
    os.makedirs(b.store.folder, exist_ok=True)
    for k in keys:
        with open(a.store.path_of(k), "rb") as src, open(b.store.path_of(k), "wb") as dst:
            dst.write(src.read())
    dst_pages = [torch.empty(PAGE_ELEMS, dtype=torch.bfloat16) for _ in keys]
    assert b.batch_get(keys, dst_pages) == [None, None]
    assert b.store.stats.faults["foreign"] == 1


def test_tier_events_reach_sglang_event_types(backend_factory) -> None:
    import msgspec
    from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch

    from kllm_plugins.plugins.kv_tiers.sglang_adapter.events import to_sglang_event

    b = backend_factory(min_reuse=1, instance_id="inst-1")
    keys = _keys(2, "e")
    assert b.batch_set(keys, _pages(2, 3))
    events = [to_sglang_event(e) for e in b.t.events.take()]
    assert len(events) == 1
    ev = events[0]
    assert isinstance(ev, BlockStored) and ev.medium == "DISK" and ev.instance_id == "inst-1"
    # wire: SGLang's decoder reads the extended event as a plain BlockStored
    wire = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=events))
    raw = msgspec.msgpack.decode(wire)
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(raw[1][0]), type=BlockStored)
    assert plain.medium == "DISK" and len(plain.block_hashes) == 2
    assert raw[1][0]["instance_id"] == "inst-1" and raw[1][0]["storage_keys"] == keys


def test_publisher_registers_and_stamps_instance_id(backend_factory) -> None:
    from sglang.srt.disaggregation.kv_events import BlockStored, EventPublisherFactory, KVEventBatch

    from kllm_plugins.plugins.kv_tiers.sglang_adapter import events

    backend_factory(instance_id="inst-2")
    check = events.register_publisher()
    assert check() and events.register_publisher()()  # idempotent
    pub = EventPublisherFactory.create('{"publisher": "kllm_tiers", "endpoint": "inproc://kvt-test"}')
    try:
        sent: list[Any] = []
        queue = pub._event_queue
        queue_put = queue.put
        queue.put = lambda item, *a, **k: sent.append(item)  # capture instead of sending
        ev = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=1, lora_id=None, medium="GPU")
        pub.publish(KVEventBatch(ts=0.0, events=[ev]))
        queue.put = queue_put
        assert sent and sent[0].events[0].instance_id == "inst-2" and sent[0].events[0].medium == "GPU"
        assert sent[0].events[0].block_hashes == [1]
    finally:
        pub.shutdown()


class _TreeCore:
    def __init__(self, own: dict[Any, list[str]]) -> None:
        self.own = own

    def get_hash_values(self, node: Any) -> list[str]:
        return self.own.get(node, [])


class _Cache:
    """The attributes of UnifiedRadixCache the prefetch and load-back hooks read and write."""

    page_size = 16

    def __init__(self, own: dict[Any, list[str]] | None = None) -> None:
        self.ongoing_prefetch: dict[Any, Any] = {}
        self.prefetch_threshold = 256
        self.load_back_threshold = 10
        self.calls = 0
        self.tree_core = _TreeCore(own or {})
        self.seen_args: list[tuple[Any, ...]] = []

    def prefetch(self, request: Any, node: Any, tokens: list[int], *args: Any, **kwargs: Any) -> bool:
        self.calls += 1
        self.seen_args.append(args)
        return True


def _store_pages(b: Any, cache: Any, tokens: list[int], pages: int | None = None, last_hash: Any = None) -> None:
    """Put the first `pages` (None: all) pages a prefetch of `tokens` would look up, so the hook's L3
    probe finds them."""
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import prefetch as pf

    keys = pf._page_keys(cache, tokens, (last_hash,), {}, pages=pages)
    assert keys is not None and len(keys) == (pages or len(tokens) // cache.page_size)
    for key in keys:
        assert b.store.put(key, memoryview(_pages(1, 99)[0].view(torch.uint8).numpy()).cast("B"))


def test_prefetch_is_not_started_when_its_first_page_is_not_in_l3(backend_factory) -> None:
    """A prefetch that would find nothing still holds its request up (HiCache's 'timeout' stop policy
    waits ~1 s for it): the hook probes the first page's storage key and starts none for a miss."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from kllm_plugins.plugins.kv_tiers.sglang_adapter import prefetch as pf

    b = backend_factory(min_reuse=1)
    cache = _Cache()
    tokens = list(range(1000, 1512))
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r1", None, tokens) is None
    assert cache.calls == 0 and b.t.counts["prefetch_probe_miss"] == 1
    # the probe's key is the one HiCache's storage query looks up first for these tokens
    first = get_storage_hash_str(tokens[:512], None, page_size=16)[0]
    assert pf._page_keys(cache, tokens, (None,), {}, pages=1)[0] == first
    chained = get_storage_hash_str(tokens[:16], first, page_size=16)[0]
    assert pf._page_keys(cache, tokens, (first,), {}, pages=1)[0] == chained != first
    assert b.batch_set([first], _pages(1, 3)) and b.store.exists(first)
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r2", None, tokens) is True
    assert cache.calls == 1 and b.t.counts["prefetch_admitted"] == 1
    # a re-issued prefetch of a known hit is not probed again
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r3", None, list(range(64)),
                                           storage_hit_end=64) is True


def test_probe_runs_without_adaptive_thresholds_for_prefetches_hicache_would_start(backend_factory) -> None:
    """With `adaptive_thresholds` off HiCache keeps its own threshold; a prefetch it would start is
    still probed (a certain miss starts none), one it declines as too short is passed through."""
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import prefetch as pf

    b = backend_factory(min_reuse=1, adaptive_thresholds=False)
    cache = _Cache()  # HiCache's default threshold, 256 tokens
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "s", None, list(range(64))) is True
    assert cache.calls == 1 and b.t.path_calls["probe"] == 0  # too short for HiCache: not probed
    tokens = list(range(1000, 1512))
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "m", None, tokens) is None
    assert cache.calls == 1 and b.t.counts["prefetch_probe_miss"] == 1
    # the first page there but not the 16th (HiCache's 256 tokens): HiCache would decline the hit
    # after its lookup, with the request waiting for it; the probe of the 16th page starts none
    _store_pages(b, cache, tokens, 1)
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "s", None, tokens) is None
    assert cache.calls == 1 and b.t.counts["prefetch_probe_short"] == 1 and b.t.path_calls["probe"] == 2
    _store_pages(b, cache, tokens, 16)
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "h", None, tokens) is True
    assert cache.calls == 2 and b.t.path_calls["probe"] == 3 and cache.prefetch_threshold == 256
    assert b.t.counts["prefetch_probe_miss"] == 1 and b.t.counts["prefetch_probe_short"] == 1


def test_probe_miss_of_a_continuation_still_shows_reuse(backend_factory) -> None:
    """Dormant (nothing written yet), every probe misses and no prefetch starts, so no L3 lookup
    happens; the hook still tells the policy what the lookup would have (a request extending a
    cached prefix), so the policy turns active and writes, instead of staying dormant for good."""
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import prefetch as pf

    b = backend_factory(min_reuse=2, write_all_below_pressure=True, reuse_window=4)
    cache = _Cache({"turn1": ["a1", "a2"]})
    for i in range(3):  # one-off prompts anchored at the root: misses, nothing reused
        assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, f"o{i}", "root",
                                               list(range(100 * i, 100 * i + 64)), None, []) is None
    assert b.t.snapshot()["write_mode"] == "dormant" and b.t.counts["prefetch_probe_miss"] == 3
    tokens = list(range(5000, 5064))
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "t2", "turn1", tokens, None, ["a1"]) is None
    assert cache.calls == 0 and b.t.counts["prefetch_probe_miss"] == 4
    assert b.t.snapshot()["write_mode"] == "active"
    # the continuation's pages were noted as such (admitted at their first sighting under pressure)
    keys = pf._page_keys(cache, tokens, (None,), {})
    assert keys is not None and len(keys) == 4
    assert all(b.t.persistence.continuations.count(k) == 1 for k in keys)


def test_prefetch_hook_completes_the_prefix_keys_with_the_anchor_node(backend_factory) -> None:
    """SGLang passes the anchor's ancestors' keys only; a lookup anchored right under the root
    would look like a request that reuses nothing. The hook adds the anchor's own keys."""
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import prefetch as pf

    b0 = backend_factory()
    cache = _Cache({"sys": ["k1", "k2"], "turn": ["k3"]})
    _store_pages(b0, cache, list(range(64)))
    pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r1", "sys", list(range(64)), "k2", [])
    pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r2", "turn", list(range(64)), "k3", ["k1", "k2"])
    pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r3", "turn", list(range(64)), "k3", None)
    pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r4", "root", list(range(64)), None, [])
    assert [a[1] for a in cache.seen_args] == [["k1", "k2"], ["k1", "k2", "k3"], None, []]
    # a lookup with the completed keys counts as a continuation: its missing pages are admitted
    # at their first sighting under pressure
    b = backend_factory(min_reuse=2)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    keys = _keys(2, "c")
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=["k1", "k2"])) == 0
    assert b.t.persistence.continuations.count(keys[0]) == 1


def test_below_pressure_every_page_is_written_at_first_sighting(backend_factory) -> None:
    """The plugin's default: a store with room takes every page (as stock write-through); the
    same pages offered to a selective store are skipped at their first sighting."""
    b = backend_factory(min_reuse=2, write_all_below_pressure=True, reuse_window=0)
    keys, pages = _keys(3, "w"), _pages(3, 7)
    assert b.batch_set(keys, pages)
    assert b.batch_exists(keys) == 3 and b.t.counts["pages_admitted"] == 3
    assert not os.path.exists(os.path.join(b.store.folder, ".seen")) or not os.listdir(
        os.path.join(b.store.folder, ".seen"))  # no offer markers when nothing is selected
    sel = backend_factory(min_reuse=2, write_all_below_pressure=False)
    other = _keys(3, "v")
    assert sel.batch_set(other, pages) and sel.batch_exists(other) == 0


def test_without_reuse_nothing_is_written_and_one_reuse_turns_write_all_on(backend_factory) -> None:
    """The default (write-all below pressure, reuse window): one-off requests write no page and no
    offer marker; once a lookup extends a cached prefix, every page is written at first sighting."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    b = backend_factory(min_reuse=2, write_all_below_pressure=True, reuse_window=4)
    seen = os.path.join(b.store.folder, ".seen")
    for i in range(6):  # one-off prompts: looked up (nothing there), computed, offered once
        keys = _keys(2, f"u{i}")
        assert b.batch_exists(keys) == 0
        assert b.batch_set(keys, _pages(2, i))
    assert b.t.counts["pages_admitted"] == 0 and len(b.store) == 0
    assert not os.path.exists(seen) or not os.listdir(seen)
    snap = b.t.snapshot()
    assert snap["write_mode"] == "dormant" and snap["path_calls"]["write"] == 6 and snap["path_calls"]["lookup"] == 6
    keys = _keys(3, "conv")  # a conversation's next turn: its lookup carries the matched prefix's keys
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=["p1"])) == 0
    assert b.t.snapshot()["write_mode"] == "active"
    other = _keys(2, "first-turn")
    assert b.batch_set(other, _pages(2, 9)) and b.batch_exists(other) == 2  # written at first sighting


def test_a_fresh_instance_writes_through_until_its_window_shows_no_reuse(backend_factory) -> None:
    """The default start (`start_active`): the first pages are written at first sighting, so a
    neighbour sharing the store finds a fresh instance's first turns; after `reuse_window` lookups
    without reuse the instance turns dormant and writes nothing more."""
    b = backend_factory(min_reuse=2, write_all_below_pressure=True, reuse_window=3, start_active=True)
    assert b.t.snapshot()["write_mode"] == "active"
    first = _keys(2, "start")
    assert b.batch_set(first, _pages(2, 1)) and b.store.prefix_hits(first) == 2
    for i in range(3):  # one-off prompts: looked up, nothing reused
        keys = _keys(2, f"u{i}")
        assert b.batch_exists(keys) == 0
        assert b.batch_set(keys, _pages(2, i))
    # the first two lookups fell inside the assumed window: their pages were written
    assert [b.store.prefix_hits(_keys(2, f"u{i}")) for i in range(3)] == [2, 2, 0]
    assert b.t.snapshot()["write_mode"] == "dormant" and b.t.counts["pages_admitted"] == 6


def test_pages_skipped_while_dormant_are_written_once_reuse_is_seen(backend_factory) -> None:
    """A conversation's first turn is offered before any reuse is seen (dormant: not written); its
    pages are held in memory and written when the next turn's lookup shows reuse, so the next turn
    landing on another instance finds them in L3. Without reuse they never reach the store."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    b = backend_factory(min_reuse=2, write_all_below_pressure=True, reuse_window=4)
    first = [_keys(3, f"turn1-{i}") for i in range(3)]
    for i, keys in enumerate(first):
        assert b.batch_exists(keys) == 0
        assert b.batch_set(keys, _pages(3, i))
    assert len(b.store) == 0 and b.t.snapshot()["held"]["pages"] == 9  # dormant: nothing written
    assert b.batch_exists(_keys(2, "turn2"), HiCacheStorageExtraInfo(prefix_keys=first[0])) == 0
    assert b.batch_set(_keys(2, "turn2"), _pages(2, 5))  # active now: the held pages go out too
    for i, keys in enumerate(first):
        assert b.batch_exists(keys) == 3
        got = b.batch_get(keys, [torch.empty(PAGE_ELEMS, dtype=torch.bfloat16) for _ in keys])
        assert all(torch.equal(g, p) for g, p in zip(got, _pages(3, i)))  # the pages as offered
    assert b.t.counts["held_written"] == 9 and b.t.snapshot()["held"]["pages"] == 0
    # with the hold switched off the first turn is dropped, as before
    off = backend_factory(min_reuse=2, write_all_below_pressure=True, reuse_window=4, dormant_hold_mb=0)
    keys = _keys(3, "off")
    assert off.batch_set(keys, _pages(3, 1))
    assert off.batch_exists(_keys(1, "x"), HiCacheStorageExtraInfo(prefix_keys=keys)) == 0
    assert off.batch_set(_keys(1, "x"), _pages(1, 2)) and off.batch_exists(keys) == 0


def test_prefetch_wait_by_load_off_keeps_one_average(backend_factory) -> None:
    from types import SimpleNamespace

    from kllm_plugins.plugins.kv_tiers.sglang_adapter import measurement as ms, prefetch as pf

    b = backend_factory(prefill_tokens_per_s=2000.0, prefetch_wait_by_load=False)
    cache = _Cache()
    cache.prefetch_loaded_tokens_by_reqid = {"r": 64}
    _store_pages(b, cache, list(range(512)))
    pf.after_process_hicache_events(None, SimpleNamespace(tree_cache=cache, waiting_queue=[object()] * 3))
    assert b.t.waiting == 3 and not b.t.busy()

    def prefetch(self: Any, request: Any, *a: Any, **k: Any) -> bool:
        self.ongoing_prefetch[request] = object()
        return True

    pf.around_prefetch_from_storage(prefetch, cache, "r", None, list(range(512)))
    ms.after_check_prefetch_progress(False, cache, "r")
    ms.after_check_prefetch_progress(True, cache, "r")
    assert b.t.fetch.l3_waits == 1 and b.t.fetch.l3_waits_busy == 0


def test_prefetch_delay_is_measured_from_the_first_blocked_admission(backend_factory) -> None:
    """A prefetch that ends while its request is still queued costs nothing; one the scheduler has
    to wait for costs the wait, which raises the L3 break-even length."""
    import time as _time

    from kllm_plugins.plugins.kv_tiers.sglang_adapter import measurement as ms, prefetch as pf

    b = backend_factory(prefill_tokens_per_s=2000.0)
    cache = _Cache()
    cache.prefetch_loaded_tokens_by_reqid = {}
    _store_pages(b, cache, list(range(512)))

    def start(rid: str) -> None:
        def prefetch(self: Any, request: Any, *a: Any, **k: Any) -> bool:
            self.ongoing_prefetch[request] = object()
            return True
        pf.around_prefetch_from_storage(prefetch, cache, rid, None, list(range(512)))

    start("queued")
    _time.sleep(0.05)  # the prefetch runs while the request waits its turn anyway
    ms.after_check_prefetch_progress(True, cache, "queued")
    cache.ongoing_prefetch.pop("queued")  # HiCache drops a finished prefetch
    assert b.t.prefetch_wait["calls"] == 1 and b.t.prefetch_wait["seconds"] == 0.0
    base = b.t.fetch.min_fetch_tokens("l3")
    for i in range(5):
        rid = f"blocked{i}"
        start(rid)
        cache.prefetch_loaded_tokens_by_reqid[rid] = 64  # what the prefetch loaded
        ms.after_check_prefetch_progress(False, cache, rid)  # the scheduler waits from here
        _time.sleep(0.04)
        ms.after_check_prefetch_progress(False, cache, rid)
        ms.after_check_prefetch_progress(True, cache, rid)
        cache.ongoing_prefetch.pop(rid)
    w = b.t.prefetch_wait
    assert w["calls"] == 6 and w["misses"] == 1 and w["loaded_tokens"] == 5 * 64 and w["seconds"] >= 5 * 0.04
    floor = 0.04 * (1 - 0.9 ** 5)  # EWMA (alpha 0.1) of five waits of at least 40 ms after one free one
    assert b.t.fetch.l3_overhead_s >= floor - 1e-9
    assert b.t.fetch.min_fetch_tokens("l3") > max(base, floor * 2000)
    assert not b.t.prefetch_started and not b.t.prefetch_blocked
    # a scheduler pass with requests waiting: the next waits are a busy server's, priced apart
    from types import SimpleNamespace

    idle_overhead = b.t.fetch.l3_overhead()
    pf.after_process_hicache_events(None, SimpleNamespace(tree_cache=cache, waiting_queue=[object()] * 3))
    assert b.t.waiting == 3
    for i in range(3):
        rid = f"busy{i}"
        start(rid)
        cache.prefetch_loaded_tokens_by_reqid[rid] = 64
        ms.after_check_prefetch_progress(False, cache, rid)
        _time.sleep(0.08)
        ms.after_check_prefetch_progress(True, cache, rid)
        cache.ongoing_prefetch.pop(rid)
    assert b.t.fetch.l3_waits_busy == 3 and b.t.fetch.l3_overhead(busy=True) >= 0.08 - 1e-3
    assert b.t.fetch.l3_overhead() == idle_overhead  # the idle estimate is left as it was
    start("busy_next")
    assert cache.prefetch_threshold == max(16, int(b.t.fetch.min_fetch_tokens("l3", 512, busy=True)))
    # the queue drained: the next decision is priced idle again
    pf.after_process_hicache_events(None, SimpleNamespace(tree_cache=cache, waiting_queue=[]))
    start("after")
    assert cache.prefetch_threshold == max(16, int(b.t.fetch.min_fetch_tokens("l3", 512)))
    assert cache.prefetch_threshold < max(16, int(b.t.fetch.min_fetch_tokens("l3", 512, busy=True)))


def test_prefetch_hook_sets_break_even_threshold_and_bounds_inflight(backend_factory) -> None:
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import prefetch as pf

    b = backend_factory(prefetch_max_inflight_ops=1, l3_read_gbps=5.0, prefill_tokens_per_s=1000.0)
    cache = _Cache()
    _store_pages(b, cache, list(range(512)))
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r1", None, list(range(512))) is True
    expected = b.t.fetch.min_fetch_tokens("l3")
    assert cache.prefetch_threshold == max(16, int(expected))
    cache.ongoing_prefetch["r1"] = object()  # one in flight: the budget is spent
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r2", None, list(range(512))) is None
    assert cache.calls == 1 and b.t.counts["prefetch_refused"] == 1
    # an already running prefetch is always let through (HiCache polls it)
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r1", None, list(range(512))) is True


def test_prefetch_hook_refuses_when_recompute_is_cheaper(backend_factory) -> None:
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import prefetch as pf

    b = backend_factory()
    for n in (16, 64, 256) * 11:  # measured (on more than trust_samples reads): a very slow disk (1 MB/s)
        b.t.fetch.observe_transfer("l3", n * 2048, n * 2048 / 1e6)
    cache = _Cache()
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r", None, list(range(512))) is None
    assert cache.prefetch_threshold >= 1 << 30 and cache.calls == 0


def test_run_batch_hook_feeds_prefill_passes_with_their_attention_pairs(backend_factory) -> None:
    """Extend batches are timed with their new tokens and, where the batch tells its requests'
    prefix and extend lengths, the attention pairs; decode batches are not prefill."""
    from types import SimpleNamespace

    from kllm_plugins.plugins.kv_tiers.sglang_adapter import measurement as ms

    b = backend_factory()
    mode = SimpleNamespace(is_extend=lambda: True)

    def run(self: Any, batch: Any) -> str:
        return "out"

    batch = SimpleNamespace(forward_mode=mode, extend_num_tokens=96, extend_lens=[64, 32], prefix_lens=[128, 0])
    assert ms._attention_pairs(batch) == 64 * (128 + 64) + 32 * 32
    assert ms.around_run_batch(run, None, batch) == "out"
    untold = SimpleNamespace(forward_mode=mode, extend_num_tokens=96)
    ms.around_run_batch(run, None, untold)
    decode = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: False), extend_num_tokens=0)
    ms.around_run_batch(run, None, decode)
    prefill = b.t.fetch.prefill
    assert prefill.samples == 1 and prefill.linear.samples == 2


def test_load_back_hook_measures_and_sets_threshold(backend_factory) -> None:
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import measurement as ms

    b = backend_factory()
    cache = _Cache()
    out = ms.around_init_load_back(lambda self, params: (128, "node"), cache, None)
    assert out == (128, "node")
    assert cache.load_back_threshold == int(b.t.fetch.min_fetch_tokens("l2"))
    assert b.t.fetch.tiers["l2"].samples == 1 and b.t.counts["l2_loaded_tokens"] == 128


def test_load_back_refused_as_slow_is_explored_every_nth_time(backend_factory) -> None:
    """An L2 measured slower than recomputing sets the load-back threshold to "never", except every
    `explore_every`-th time, when the load-back runs so that L2 is re-measured."""
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import measurement as ms

    b = backend_factory(explore_every=4)
    for n in (16, 64, 256) * 11:  # measured (on more than trust_samples loads): host copies at 0.1 MB/s
        b.t.fetch.observe_transfer("l2", n * 2048, n * 2048 / 1e5)
    assert b.t.fetch.min_fetch_tokens("l2") == float("inf")
    cache = _Cache()
    thresholds = []
    for _ in range(8):
        ms.around_init_load_back(lambda self, params: (0, "node"), cache, None)
        thresholds.append(cache.load_back_threshold)
    assert [th < 1 << 30 for th in thresholds] == [False, False, False, True] * 2, thresholds
    assert b.t.counts["l2_explored"] == 2


def test_every_patch_target_resolves_against_installed_sglang() -> None:
    from kllm_plugins.attach import resolve_impl, resolve_target
    from kllm_plugins.plugins.kv_tiers.hookimpls import kllm_declare

    spec = kllm_declare()
    for patch in spec.patches:
        assert resolve_target(patch.target) is not None, patch.target
        assert callable(resolve_impl(patch.impl)), patch.impl


def test_second_sighting_may_happen_on_another_instance(backend_factory, tmp_path) -> None:
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import state

    a = backend_factory(min_reuse=2)
    keys, pages = _keys(3, "s"), _pages(3, 5)
    assert a.batch_set(keys, pages) and a.batch_exists(keys) == 0  # A's first sighting: skipped
    a_tiers = state._tiers
    b = backend_factory(min_reuse=2)  # another instance (fresh per-process state), same folder
    assert state._tiers is not a_tiers
    assert b.batch_set(keys, pages)  # B's first, the page's second sighting: written
    assert b.batch_exists(keys) == 3 and b.t.counts["pages_admitted"] == 3
    assert not os.listdir(os.path.join(b.store.folder, ".seen"))  # markers of written pages are gone
    other = _keys(2, "t")
    assert b.batch_set(other, _pages(2, 6)) and b.batch_exists(other) == 0  # unseen elsewhere: skipped


def test_slow_store_is_measured_and_then_recomputed(backend_factory, monkeypatch, caplog) -> None:
    """A store that turns slow: its reads are timed, the break-even length becomes "never", the
    prefetch hook refuses L3 for new requests, and a metric and a log line say why."""
    import time

    from kllm_plugins.plugins.kv_tiers.sglang_adapter import prefetch as pf
    from kllm_plugins.plugins.kv_tiers.core import file_store

    b = backend_factory(min_reuse=1, explore_every=0, prefill_tokens_per_s=20000.0)
    keys, pages = _keys(4, "slow"), _pages(4, 9)
    assert b.batch_set(keys, pages)
    cache = _Cache()
    _store_pages(b, cache, list(range(512)))
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r0", None, list(range(512))) is True

    fast_readv = os.readv

    def slow_readv(*args: Any) -> Any:  # a disk answering in 50 ms a page
        time.sleep(0.05)
        return fast_readv(*args)

    monkeypatch.setattr(file_store.os, "readv", slow_readv)
    for _ in range(4):
        dst = [torch.empty(PAGE_ELEMS, dtype=torch.bfloat16) for _ in keys]
        assert all(g is not None for g in b.batch_get(keys, dst))  # still correct, only slow
    with caplog.at_level("WARNING", logger="kllm.kv_tiers"):
        assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r1", None, list(range(512))) is None
    assert cache.prefetch_threshold >= 1 << 30 and cache.calls == 1
    assert "l3 is slower than recomputing" in caplog.text
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("kllm_kv_tiers_l3_faults_total",
                                     {"reason": "l3_slower_than_recompute"}) >= 1


def test_store_refused_as_slow_is_re_measured_and_used_again_when_fast(backend_factory, monkeypatch) -> None:
    """A store measured slower than recomputing is not written off for the server's lifetime: every
    `explore_every`-th refused prefetch starts anyway, its reads re-measure the store, and once the
    store is fast again prefetches are admitted by the break-even length as before."""
    import time

    from kllm_plugins.plugins.kv_tiers.sglang_adapter import prefetch as pf
    from kllm_plugins.plugins.kv_tiers.core import file_store

    b = backend_factory(min_reuse=1, explore_every=3, prefill_tokens_per_s=20000.0)
    keys, pages = _keys(4, "back"), _pages(4, 9)
    assert b.batch_set(keys, pages)
    cache = _Cache()
    _store_pages(b, cache, list(range(512)))

    def read_all() -> None:
        dst = [torch.empty(PAGE_ELEMS, dtype=torch.bfloat16) for _ in keys]
        assert all(g is not None for g in b.batch_get(keys, dst))

    fast_readv = os.readv

    def slow_readv(*args: Any) -> Any:  # a disk answering in 50 ms a page
        time.sleep(0.05)
        return fast_readv(*args)

    monkeypatch.setattr(file_store.os, "readv", slow_readv)
    for _ in range(8):  # 32 page reads: trust_samples, so refusals are no longer all explored
        read_all()
    assert b.t.fetch.min_fetch_tokens("l3") == float("inf")
    started = [pf.around_prefetch_from_storage(_Cache.prefetch, cache, f"r{i}", None, list(range(512)))
               for i in range(6)]
    assert started == [None, None, True, None, None, True], started  # the 3rd and 6th refusals explore
    assert cache.calls == 2 and b.t.counts["prefetch_explored"] == 2
    monkeypatch.undo()  # the disk is fast again; the explored prefetches' reads see it
    for _ in range(30):
        read_all()
    assert b.t.fetch.min_fetch_tokens("l3") < 512
    assert pf.around_prefetch_from_storage(_Cache.prefetch, cache, "r9", None, list(range(512))) is True
    assert cache.calls == 3 and b.t.counts["prefetch_explored"] == 2  # admitted on its merits


def test_lookup_that_extends_a_cached_prefix_marks_continuations(backend_factory) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    b = backend_factory(min_reuse=2)
    turn1, turn2 = _keys(2, "u1"), _keys(2, "u2")
    assert b.batch_exists(turn1, HiCacheStorageExtraInfo(prefix_keys=[])) == 0  # nothing cached before
    assert b.batch_set(turn1, _pages(2, 1)) and b.batch_exists(turn1) == 0  # one-off so far: skipped
    assert b.batch_exists(turn2, HiCacheStorageExtraInfo(prefix_keys=turn1)) == 0  # next turn of a cached prefix
    assert b.batch_set(turn2, _pages(2, 2)) and b.batch_exists(turn2) == 2  # written at first sighting


# -- zero-copy interface (batch_get_v1 / batch_set_v1) on SGLang's own MHA host pool page methods --


def _mha_pool(layout: str, pages: int = 8, seed: int = 0) -> Any:
    from kllm_plugins.plugins.kv_tiers.testing import mha_host_pool

    return mha_host_pool(layout, pages, seed=seed)


def _host_indices(pages: list[int], ps: int = 16) -> torch.Tensor:
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages])


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_zero_copy_pages_round_trip_through_the_host_pool_in_place(backend_factory, layout) -> None:
    pool = _mha_pool(layout)
    b = backend_factory(pool=pool, min_reuse=1)
    assert b.pages is not None  # the pool's pages are addressed in place
    assert b.storage_config.extra_config["interface_v1"] == 1  # HiCache will call batch_*_v1
    keys = _keys(3, "z" + layout)
    src = [2, 5, 6]
    want = [pool.get_data_page(p * 16).clone() for p in src]  # SGLang's flat page
    assert b.batch_set_v1(keys, _host_indices(src)) == [True] * 3
    # the bytes stored are SGLang's flat page: the generic path reads them back unchanged
    dst = [pool.get_dummy_flat_data_page() for _ in keys]
    assert all(g is not None for g in b.batch_get(keys, dst))
    for d, w in zip(dst, want):
        assert torch.equal(d, w)
    # zero-copy read into other pages of the pool, which change there and nowhere else
    before = pool.kv_buffer.clone()
    dst_pages = [7, 0, 3]
    assert b.batch_get_v1(keys, _host_indices(dst_pages)) == [True] * 3
    for p, w in zip(dst_pages, want):
        assert torch.equal(pool.get_data_page(p * 16), w)
    for p in (1, 2, 4, 5, 6):
        assert torch.equal(pool.get_data_page(p * 16), before[tuple(_page_index(layout, p))].flatten())


def _page_index(layout: str, p: int) -> list[Any]:
    s = slice(p * 16, (p + 1) * 16)
    return {"layer_first": [slice(None), slice(None), s], "page_first": [slice(None), s],
            "page_first_direct": [slice(None), slice(p, p + 1)]}[layout]


def test_zero_copy_read_stops_at_a_corrupt_page_and_the_staging_fallback_gives_the_same_bytes(backend_factory) -> None:
    pool = _mha_pool("layer_first", seed=3)
    b = backend_factory(pool=pool, min_reuse=1)
    keys = _keys(3, "zc")
    want = [pool.get_data_page(p * 16).clone() for p in (0, 1, 2)]
    # written through the staging path (no in-place pages), read in place: same bytes
    pages, b.pages = b.pages, None
    assert b.batch_set_v1(keys, _host_indices([0, 1, 2])) == [True] * 3
    b.pages = pages
    assert b.batch_get_v1(keys, _host_indices([4, 5, 6])) == [True] * 3
    assert all(torch.equal(pool.get_data_page(p * 16), w) for p, w in zip((4, 5, 6), want))
    path = b.store.path_of(keys[1])
    raw = bytearray(open(path, "rb").read())
    raw[-5] ^= 0x10
    open(path, "wb").write(bytes(raw))
    assert b.batch_get_v1(keys, _host_indices([7, 3, 2])) == [True, False, False]
    assert b.store.stats.faults["corrupt"] == 1
    # the staging read path refuses the same way
    b.pages = None
    assert b.batch_get_v1(keys, _host_indices([7, 3, 2])) == [True, False, False]
    assert torch.equal(pool.get_data_page(7 * 16), want[0])


def test_interface_v1_left_off_when_the_config_says_0(backend_factory) -> None:
    b = backend_factory(interface_v1=0)
    assert b.storage_config.extra_config["interface_v1"] == 0
    assert b.pages is None  # the stand-in pool has no buffer: pages would go through a staging copy


def test_prefetches_refused_for_l2_room_are_deferred_and_reissued_in_queue_order(backend_factory) -> None:
    """With the admission hold's L2 budget full, a prefetch is deferred (not recomputed) unless the
    probe calls it a miss; each scheduler pass re-issues the deferred ones in waiting-queue order and
    stops at the first that is deferred again; admission or abort forgets a deferral."""
    from types import SimpleNamespace

    from kllm_plugins.plugins.kv_tiers.sglang_adapter import admission as adm, prefetch as pf

    b = backend_factory(prefill_tokens_per_s=100.0, l3_read_gbps=50.0, prefetch_max_inflight_ops=8,
                        admission_hold_fraction=0.5)
    cache = _Cache()
    cache.cache_controller = SimpleNamespace(mem_pool_host=SimpleNamespace(size=2048))  # budget 1024 tokens
    tokens = list(range(512))
    _store_pages(b, cache, tokens)

    def prefetch(self: Any, request: Any, *a: Any, **k: Any) -> bool:
        self.ongoing_prefetch[request] = SimpleNamespace(hash_value=[0] * 32)  # 512 tokens in flight
        return True

    assert pf.around_prefetch_from_storage(prefetch, cache, "r1", None, tokens) is True
    assert pf.around_prefetch_from_storage(prefetch, cache, "r2", None, tokens) is True  # 1024: full
    assert pf.around_prefetch_from_storage(prefetch, cache, "r3", None, tokens) is None
    assert pf.around_prefetch_from_storage(prefetch, cache, "r4", None, tokens) is None
    assert list(b.t.deferred) == ["r3", "r4"] and b.t.counts["prefetch_deferred"] == 2
    # a certain miss is not deferred: its prefix is recomputed at once
    assert pf.around_prefetch_from_storage(prefetch, cache, "miss", None, list(range(900, 1412))) is None
    assert "miss" not in b.t.deferred

    issued: list[str] = []

    class _Scheduler:
        tree_cache = cache
        waiting_queue = [SimpleNamespace(cache_request_handle=h) for h in ("r9", "r4", "r3")]

        def _prefetch_kvcache(self, req: Any) -> None:
            issued.append(req.cache_request_handle)
            pf.around_prefetch_from_storage(prefetch, cache, req.cache_request_handle, None, tokens)

    sched = _Scheduler()
    pf.after_process_hicache_events(None, sched)  # still full: r4 (first in the queue) is deferred again
    assert issued == ["r4"] and list(b.t.deferred) == ["r3", "r4"]
    pf.after_process_hicache_events(None, sched)  # nothing ended or was released: no walk at all
    assert issued == ["r4"]
    del cache.ongoing_prefetch["r1"]  # a prefetch ended: room for one
    issued.clear()
    pf.after_process_hicache_events(None, sched)
    assert issued == ["r4", "r3"] and "r4" in cache.ongoing_prefetch and list(b.t.deferred) == ["r3"]
    adm.after_finish_storage_prefetch_admission(None, cache, "r3", 0, None)  # admitted without its prefetch
    assert not b.t.deferred and b.t.counts["prefetch_reissued"] == 3


def test_l2_budget_counts_prefetches_whose_hit_query_has_not_run(backend_factory) -> None:
    """The gate's in-flight tokens come from SGLang's own `ongoing_prefetch` entries: the operation
    is the entry's `operation` field (reading the entry's last field counted every prefetch as 0
    tokens), and before the storage thread's hit query has run it counts its candidate span. With
    either gap the gate started more prefetches than the hold's L2 budget keeps, and on a loaded
    machine the span past the budget was refused a hold and evicted before admission (the
    admission-hold e2e test failed with 256 tokens of `cache_admission_shortfall`)."""
    from types import SimpleNamespace

    from sglang.srt.managers.cache_controller import PrefetchOperation
    from sglang.srt.mem_cache.unified_radix_cache import _OngoingPrefetch

    from kllm_plugins.plugins.kv_tiers.sglang_adapter import prefetch as pf

    b = backend_factory(prefill_tokens_per_s=100.0, l3_read_gbps=50.0, prefetch_max_inflight_ops=8,
                        admission_hold_fraction=0.5)
    cache = _Cache()
    cache.cache_controller = SimpleNamespace(mem_pool_host=SimpleNamespace(size=2048))  # budget 1024 tokens
    tokens = list(range(512))
    _store_pages(b, cache, tokens)

    def entry(request: Any, new_tokens: list[int]) -> Any:
        # the entry as SGLang 0.5.23 keeps it (the operation is not its last field)
        op = PrefetchOperation(request, list(new_tokens))  # its hit query has not run yet
        return _OngoingPrefetch(None, None, None, op, None, {})

    def prefetch(self: Any, request: Any, node: Any, new_tokens: list[int], *a: Any, **k: Any) -> bool:
        self.ongoing_prefetch[request] = entry(request, new_tokens)
        return True

    assert pf._inflight(cache) == (0, 0)
    assert pf.around_prefetch_from_storage(prefetch, cache, "r1", None, tokens) is True
    assert pf._inflight(cache) == (1, 512)  # the whole candidate span, before the query
    assert pf.around_prefetch_from_storage(prefetch, cache, "r2", None, tokens) is True  # 1024: full
    assert pf.around_prefetch_from_storage(prefetch, cache, "r3", None, tokens) is None
    assert list(b.t.deferred) == ["r3"]
    # once r1's query has run and found 10 of its 32 pages, it counts those pages only
    op = cache.ongoing_prefetch["r1"].operation
    op.all_hash_values = [str(i) for i in range(32)]
    op.hash_value = op.all_hash_values[:10]
    assert pf._inflight(cache) == (2, 10 * 16 + 512)
    # a span that is not page-aligned counts its whole pages only (what HiCache can load)
    cache.ongoing_prefetch["r4"] = entry("r4", list(range(40)))
    assert pf._inflight(cache) == (3, 10 * 16 + 512 + 32)


def test_the_store_measures_its_reads_at_start_and_leaves_only_its_namespace(backend_factory, tmp_path,
                                                                              caplog) -> None:
    """With the calibration on (the default), the cost model starts from this store's reads: a
    store priced at a prior below the recompute would otherwise never be read, so never measured
    (the H200 run refused every L3 prefetch on the 1 GB/s prior)."""
    import logging

    with caplog.at_level(logging.INFO):
        b = backend_factory(l3_calibration_pages=4, l3_read_gbps=0.001)
    snap = b.t.fetch.snapshot()
    assert snap["l3_samples"] == 4.0
    assert snap["l3_bandwidth_bytes_per_s"] > 0.001e9  # the prior (1 MB/s) is gone: page-cache reads
    assert "L3 reads measured at start over 4 pages" in caplog.text
    assert os.listdir(tmp_path) == [os.path.basename(b.store.folder)] and len(b.store) == 0

