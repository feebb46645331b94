"""Unit tests of kv_tiers' prefetch planner and tier state (core, no SGLang): the decisions the
adapter applies to HiCache's prefetch calls, and timings on an injected clock."""
from __future__ import annotations

import math

from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
from kllm_plugins.plugins.kv_tiers.core.prefetch_plan import (
    NO_FETCH_THRESHOLD,
    PrefetchAsk,
    engaged,
    load_back_threshold,
    plan_prefetch,
    probe_pages,
)
from kllm_plugins.plugins.kv_tiers.core.tier_state import TierState


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _state(clock: _Clock | None = None, probe: bool = True, fetch: bool = True, **cfg: object) -> TierState:
    t = TierState(KvTiersConfig(**cfg), "test:1", clock=clock or _Clock())  # type: ignore[arg-type]
    if fetch:
        t.ensure_fetch_policy(1024)
    if probe:
        t.probe = lambda key: True
    return t


def _ask(**kw: object) -> PrefetchAsk:
    base = dict(candidate_tokens=512, context_tokens=512, page_size=16, in_flight=False, hicache_threshold=256)
    return PrefetchAsk(**{**base, **kw})  # type: ignore[arg-type]


def test_plugin_stays_out_without_adaptive_thresholds_and_probe() -> None:
    t = _state(probe=False, adaptive_thresholds=False)
    assert not engaged(t)
    assert engaged(_state(probe=True, adaptive_thresholds=False)) and engaged(_state(probe=False))


def test_adaptive_plan_sets_the_break_even_threshold_and_asks_the_gate() -> None:
    t = _state()
    plan = plan_prefetch(t, _ask())
    want = t.fetch.min_fetch_tokens("l3", 512)
    assert plan.threshold == max(16, int(want)) and plan.gate is not None and plan.gate.admit
    assert plan.start and plan.probe and plan.track and not plan.defer


def test_a_store_slower_than_recompute_sets_never_and_refuses() -> None:
    t = _state(explore_every=0)
    for _ in range(50):  # a store at 1 MB/s with 50 ms latency
        t.fetch.observe_transfer("l3", 1 << 20, 1.05)
    plan = plan_prefetch(t, _ask())
    assert plan.threshold == NO_FETCH_THRESHOLD and not plan.start and plan.gate.reason == "recompute_cheaper"
    assert not plan.defer


def test_a_prefetch_in_flight_only_gets_the_threshold() -> None:
    plan = plan_prefetch(_state(), _ask(in_flight=True))
    assert plan.gate is None and plan.start and not plan.track and plan.threshold is not None


def test_without_adaptive_thresholds_hicache_threshold_decides_first() -> None:
    t = _state(adaptive_thresholds=False)
    below = plan_prefetch(t, _ask(candidate_tokens=128))  # under HiCache's 256
    assert below.gate is None and below.threshold is None and not below.probe and not below.track
    plan = plan_prefetch(t, _ask())
    assert plan.threshold is None and plan.gate.admit and plan.probe


def test_refusal_for_room_is_deferred_only_with_the_holds_on() -> None:
    t = _state()
    full = dict(inflight_ops=1, inflight_tokens=0, held_tokens=1024, l2_budget=1200.0)
    held = plan_prefetch(t, _ask(**full, holds_on=True))
    assert not held.start and held.gate.reason == "l2_budget" and held.defer and held.probe
    ops = plan_prefetch(t, _ask(inflight_ops=4, holds_on=False))
    assert not ops.start and ops.gate.reason == "ops_budget" and not ops.defer


def test_a_reissued_known_hit_is_not_probed_again() -> None:
    assert not plan_prefetch(_state(), _ask(reissued_hit=True)).probe


def test_probe_pages_reach_the_threshold() -> None:
    assert probe_pages(32, 0, 16) == 1 and probe_pages(32, 5, 16) == 1
    assert probe_pages(32, 100, 16) == 7 and probe_pages(4, 1000, 16) == 4


def test_load_back_threshold_follows_l2_and_explores_when_never() -> None:
    t = _state(explore_every=2)
    assert load_back_threshold(_state(adaptive_thresholds=False)) is None
    for _ in range(50):  # an L2 far slower than recomputing
        t.fetch.observe_transfer("l2", 1 << 20, 2.0)
    got = [load_back_threshold(t) for _ in range(4)]
    assert NO_FETCH_THRESHOLD in got and 0 in got and t.counts["l2_explored"] == got.count(0)


def test_prefetch_wait_is_measured_on_the_injected_clock() -> None:
    clock = _Clock()
    t = _state(clock)
    t.prefetch_begun("r")
    clock.now += 5.0  # queued behind other work: costs nothing
    t.prefetch_blocking("r")
    clock.now += 0.25
    t.prefetch_blocking("r")  # asked again: the wait counts from the first time
    clock.now += 0.5
    assert t.prefetch_done("r", 64) == 0.75
    t.prefetch_begun("s")
    clock.now += 1.0
    assert t.prefetch_done("s", 0) == 0.0  # finished while queued
    w = t.prefetch_wait
    assert w["calls"] == 2 and w["seconds"] == 0.75 and w["max_s"] == 0.75 and w["misses"] == 1
    assert t.prefetch_done("never-started", 1) is None


def test_threshold_turns_are_logged_at_most_once_a_minute(caplog) -> None:
    clock = _Clock()
    t = _state(clock)
    with caplog.at_level("INFO", logger="kllm.kv_tiers"):
        t.note_threshold("l3", math.inf)
        t.note_threshold("l3", 64.0)  # turned back within the minute: not logged
        clock.now += 61
        t.note_threshold("l3", math.inf)
    assert caplog.text.count("slower than recomputing") == 2 and "worth fetching again" not in caplog.text


def test_holds_expire_on_the_state_clock() -> None:
    clock = _Clock()
    t = _state(clock, admission_hold_max_s=10.0)
    holds = t.ensure_holds(1000)
    assert holds is not None and holds.max_tokens == 500  # admission_hold_fraction 0.5
    holds.hold("r", "lock", 100, t.clock())
    clock.now += 9.9
    assert holds.expired(t.clock()) == []
    clock.now += 0.2
    assert holds.expired(t.clock()) == ["lock"]
    assert _state(admission_hold=False).ensure_holds(1000) is None
