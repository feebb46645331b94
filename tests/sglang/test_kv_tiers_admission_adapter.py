"""kv_tiers' admission-hold adapter (sglang_adapter/admission.py) against a stand-in of SGLang's
radix cache: a re-issued lookup moves the hold to the fresh span, a lock whose node the tree lost
is counted instead of ending the scheduler (a server crashed on it under load with the Rust
TreeCore: KeyError from dec_host_lock_ref), and a flush drops the holds without touching the
rebuilt tree."""
from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import pytest

from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
from kllm_plugins.plugins.kv_tiers.core.tier_state import TierState
from kllm_plugins.plugins.kv_tiers.sglang_adapter import admission, state

pytestmark = pytest.mark.sglang


class _Cache:
    """What the hooks call on UnifiedRadixCache: match, lock and unlock host nodes."""

    def __init__(self) -> None:
        self.cache_controller = SimpleNamespace(mem_pool_host=SimpleNamespace(size=10_000))
        self.prefetch_loaded_tokens_by_reqid: dict[str, int] = {}
        self.next_node = 100
        self.locked: dict[int, int] = {}
        self.gone: set[int] = set()
        self.unlocks: list[int] = []

    def match_prefix(self, params: Any) -> Any:
        self.next_node += 1
        return SimpleNamespace(last_host_node=self.next_node)

    def is_root(self, node: int) -> bool:
        return False

    def inc_host_lock_ref(self, node: int) -> Any:
        self.locked[node] = self.locked.get(node, 0) + 1
        return SimpleNamespace(to_dec_params=lambda: ("params", node))

    def dec_host_lock_ref(self, node: int, params: Any) -> None:
        if node in self.gone:
            raise KeyError(node)
        assert params == ("params", node)
        self.unlocks.append(node)
        self.locked[node] -= 1


@pytest.fixture()
def tiers(monkeypatch: pytest.MonkeyPatch) -> TierState:
    t = TierState(KvTiersConfig(), "cpu-test")
    monkeypatch.setattr(state, "_tiers", t)
    return t


def _land(t: TierState, cache: _Cache, request: str, tokens: int = 64) -> None:
    """A finished prefetch of `tokens` tokens for `request` lands in the host tree."""
    cache.prefetch_loaded_tokens_by_reqid[request] = tokens
    t.prefetch_spans[request] = (array("q", range(tokens)), None, None)
    admission.after_handle_prefetch_result(None, cache, SimpleNamespace(handle=request))


def test_a_reissued_lookup_moves_the_hold_to_the_fresh_span(tiers: TierState) -> None:
    cache = _Cache()
    _land(tiers, cache, "r1")
    assert cache.locked == {101: 1} and "r1" in tiers.holds
    _land(tiers, cache, "r1")  # HiCache re-issued the lookup: a new span, a new node
    assert cache.locked == {101: 0, 102: 1} and cache.unlocks == [101]
    assert tiers.holds.snapshot()["reheld"] == 1 and tiers.holds.tokens == 64
    admission.after_finish_storage_prefetch_admission(None, cache, "r1")
    assert cache.locked == {101: 0, 102: 0} and len(tiers.holds) == 0


def test_a_lock_on_a_node_the_tree_lost_is_counted_not_raised(tiers: TierState) -> None:
    cache = _Cache()
    _land(tiers, cache, "r1")
    cache.gone.add(101)
    admission.after_finish_storage_prefetch_admission(None, cache, "r1")  # must not raise
    assert len(tiers.holds) == 0 and tiers.holds.snapshot()["admitted"] == 1
    assert tiers.holds.snapshot().get("release_failed") == 1
    # the same on the expiry path
    _land(tiers, cache, "r2")
    cache.gone.add(102)
    tiers.holds._holds["r2"].since = tiers.clock() - 2 * tiers.holds.max_age_s  # past its age
    _land(tiers, cache, "r3")
    assert "r2" not in tiers.holds and "r3" in tiers.holds
    assert tiers.holds.snapshot()["expired"] == 1 and tiers.holds.snapshot()["release_failed"] == 2


def test_a_flush_drops_the_holds_without_unlocking_the_rebuilt_tree(tiers: TierState) -> None:
    cache = _Cache()
    _land(tiers, cache, "r1")
    _land(tiers, cache, "r2")
    admission.after_reset(None, cache)
    assert len(tiers.holds) == 0 and tiers.holds.tokens == 0 and cache.unlocks == []
    assert tiers.holds.snapshot()["reset"] == 2
    admission.after_finish_storage_prefetch_admission(None, cache, "r1")  # nothing left to release
    assert cache.unlocks == []
