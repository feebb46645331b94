"""incr_prefix adapter on real SGLang classes: registry attachment, the SGLang internals it drives,
stale-state detection with counted fallback, and the routes that must stay stock."""
from __future__ import annotations

import pkgutil

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang


def _pair(page_size: int = 1, tree_core: str = "python", **cfg: object):  # type: ignore[no-untyped-def]
    from kllm_plugins.plugins.incr_prefix.config import IncrPrefixConfig
    from kllm_plugins.plugins.incr_prefix.sglang_adapter import build_cpu_cache
    from kllm_plugins.plugins.incr_prefix.sglang_testing import CacheDriver

    kw = dict(page_size=page_size, kv_size=4096, max_context_len=2048, max_num_reqs=4, tree_core=tree_core)
    stock = CacheDriver(*build_cpu_cache(**kw))
    ours = CacheDriver(*build_cpu_cache(**kw, incremental=True, config=IncrPrefixConfig(**cfg)))
    return stock, ours


def _prefill(stock, ours, tokens, chunk):  # type: ignore[no-untyped-def]
    a, b = stock.admit("r", tokens), ours.admit("r", tokens)
    while a.done < len(tokens):
        assert stock.extend(a, chunk) and ours.extend(b, chunk)
    return a, b


def test_every_sglang_internal_the_tail_path_drives_resolves() -> None:
    from kllm_plugins.plugins.incr_prefix.hookimpls import PYTHON_TREECORE_INTERNALS

    for dotted in PYTHON_TREECORE_INTERNALS:
        assert pkgutil.resolve_name(dotted) is not None, dotted


def test_registry_patch_registers_once_and_reports_it() -> None:
    from kllm_plugins.plugins.incr_prefix.sglang_adapter import BACKEND_NAME, register_backend
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, registered_radix_cache_backends

    check = register_backend()
    assert check() is True
    assert register_backend()() is True  # idempotent: a second process-local call is a no-op
    assert registered_radix_cache_backends().count(BACKEND_NAME) == 1
    assert get_radix_cache_factory(BACKEND_NAME) is not None


def test_stale_state_is_detected_and_falls_back_to_the_stock_walk() -> None:
    from kllm_plugins.plugins.incr_prefix.sglang_adapter import _REQ_ATTR
    from kllm_plugins.plugins.incr_prefix.sglang_testing import tree_snapshot

    stock, ours = _pair()
    tokens = list(range(1, 1001))
    a, b = stock.admit("r", tokens), ours.admit("r", tokens)
    for _ in range(3):
        stock.extend(a, 100), ours.extend(b, 100)
    assert ours.cache.kllm_counters.tail_inserts == 2
    state, anchor = getattr(b.req, _REQ_ATTR)
    # A saved state whose depth no longer matches the request (as after a re-anchoring).
    setattr(b.req, _REQ_ATTR, (type(state)(state.node_id, state.depth - 1, state.epoch), anchor))
    stock.extend(a, 100), ours.extend(b, 100)
    assert ours.cache.kllm_counters.fallbacks == 1
    assert tree_snapshot(ours.cache) == tree_snapshot(stock.cache)
    # ... and the stock walk re-records a good state: the next chunk is tail-only again.
    stock.extend(a, 100), ours.extend(b, 100)
    assert ours.cache.kllm_counters.tail_inserts == 3
    # A cache reset invalidates every saved state through the epoch.
    epoch = ours.cache.kllm_epoch
    ours.cache.kllm_epoch += 1
    stock.extend(a, 100), ours.extend(b, 100)
    assert ours.cache.kllm_counters.fallbacks == 2
    ours.cache.kllm_epoch = epoch + 1
    assert tree_snapshot(ours.cache) == tree_snapshot(stock.cache)


@pytest.mark.parametrize(
    ("cfg", "reason", "count"),
    # 8 checkpoints; with the fast path on, the first one is the state-recording stock walk
    [({"enabled": False}, "disabled", 8), ({"min_prefix_tokens": 10_000}, "short", 7)],
)
def test_switches_route_every_checkpoint_to_stock(cfg: dict[str, object], reason: str, count: int) -> None:
    from kllm_plugins.plugins.incr_prefix.sglang_testing import tree_snapshot

    stock, ours = _pair(**cfg)
    _prefill(stock, ours, list(range(1, 801)), 100)
    c = ours.cache.kllm_counters
    assert c.tail_inserts == 0 and c.full_by_reason[reason] == count
    assert tree_snapshot(ours.cache) == tree_snapshot(stock.cache)


def test_rust_treecore_checkpoints_take_the_tail_path_and_match_stock() -> None:
    """On the Rust core the walk stays the binding's; the key, value and new-index work of every
    checkpoint after the first is tail-only, and the tree is stock's (same binding calls)."""
    from kllm_plugins.plugins.incr_prefix.sglang_testing import tree_snapshot

    stock, ours = _pair(tree_core="rust")
    assert type(ours.cache.tree_core).__name__ == "RustUnifiedTreeCore"
    tokens = list(range(1, 801))
    a, b = _prefill(stock, ours, tokens, 100)
    c = ours.cache.kllm_counters
    assert c.tail_inserts == 7 and c.full_by_reason == {"no_state": 1}
    assert c.skipped_tokens == sum(range(100, 800, 100))
    assert a.req.kv.cache_protected_len == b.req.kv.cache_protected_len == 800
    assert tree_snapshot(ours.cache) == tree_snapshot(stock.cache)
    row = slice(0, 800)
    assert stock.pool.req_to_token[a.req.kv.req_pool_idx, row].tolist() == ours.pool.req_to_token[b.req.kv.req_pool_idx, row].tolist()
    stock.finish(a), ours.finish(b)
    assert stock.match_len(tokens) == ours.match_len(tokens) == 800
    assert tree_snapshot(ours.cache) == tree_snapshot(stock.cache)


def test_rust_tail_state_goes_stale_when_the_request_is_readmitted() -> None:
    stock, ours = _pair(tree_core="rust")
    tokens = list(range(1, 401))
    a, b = stock.admit("r", tokens), ours.admit("r", tokens)
    for _ in range(2):
        assert stock.extend(a, 100) and ours.extend(b, 100)
    stock.retract(a), ours.retract(b)
    a, b = stock.readmit(a), ours.readmit(b)
    while a.done < len(tokens):
        assert stock.extend(a, 100) and ours.extend(b, 100)
    c = ours.cache.kllm_counters
    # The retraction dropped the state: the re-admitted request starts over with a stock walk.
    assert c.full_by_reason.get("no_state") == 2 and c.fallbacks == 0
    from kllm_plugins.plugins.incr_prefix.sglang_testing import tree_snapshot

    assert tree_snapshot(ours.cache) == tree_snapshot(stock.cache)


def test_page_size_16_tail_inserts_keep_page_alignment() -> None:
    from kllm_plugins.plugins.incr_prefix.sglang_testing import tree_snapshot

    stock, ours = _pair(page_size=16)
    a, b = _prefill(stock, ours, list(range(1, 1001)), 100)  # chunks end off page boundaries
    assert b.req.kv.cache_protected_len == a.req.kv.cache_protected_len == 992
    assert ours.cache.kllm_counters.tail_inserts == 9
    assert tree_snapshot(ours.cache) == tree_snapshot(stock.cache)


def test_hicache_attached_after_construction_turns_the_tail_path_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """`create_unified_radix_cache` calls `init_hicache` after building the cache; the tail
    path does not reproduce HiCache's write-through bookkeeping, so it must step aside."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    def fake_init_hicache(self, server_args, params):  # type: ignore[no-untyped-def]
        self.cache_controller = object()

    monkeypatch.setattr(UnifiedRadixCache, "init_hicache", fake_init_hicache)
    _, ours = _pair()
    ours.cache.init_hicache(None, None)
    run = ours.admit("r", list(range(1, 301)))
    ours.extend(run, 100), ours.extend(run, 100)
    c = ours.cache.kllm_counters
    assert c.tail_inserts == 0 and c.full_by_reason == {"unsupported_cache": 2}
    ours.cache.cache_controller = None  # let teardown paths see a plain cache again
