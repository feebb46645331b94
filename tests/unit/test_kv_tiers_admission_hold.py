"""Unit tests of the admission holds of L3-loaded L2 spans and the gate's L2 budget (core, no SGLang)."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kllm_plugins.plugins.kv_tiers.core.admission_hold import AdmissionHolds
from kllm_plugins.plugins.kv_tiers.core.prefetch_gate import PrefetchGate


def test_holds_stay_within_budget_and_each_lock_comes_back_once() -> None:
    h: AdmissionHolds[str] = AdmissionHolds(max_tokens=1000, max_age_s=10.0)
    assert h.room_for(600)
    h.hold("a", "lock-a", 600, now=0.0)
    assert not h.room_for(500) and h.room_for(400) and not h.room_for(0)
    h.refuse(500)
    h.hold("b", "lock-b", 400, now=1.0)
    assert h.tokens == 1000 and len(h) == 2 and "a" in h
    with pytest.raises(ValueError, match="already held"):
        h.hold("a", "again", 1, now=2.0)
    with pytest.raises(ValueError, match="budget"):
        h.hold("c", "lock-c", 1, now=2.0)
    assert h.release("a", "admitted") == "lock-a"
    assert h.release("a", "admitted") is None  # released once
    assert h.release("zz", "aborted") is None  # never held
    assert h.release("b", "aborted") == "lock-b"
    snap = h.snapshot()
    assert snap["held"] == 2 and snap["held_tokens"] == 1000 and snap["admitted"] == 1 and snap["aborted"] == 1
    assert snap["over_budget"] == 1 and snap["over_budget_tokens"] == 500 and snap["held_now"] == 0
    assert h.tokens == 0


def test_clear_drops_every_hold_and_gives_the_locks_back_in_order() -> None:
    h: AdmissionHolds[str] = AdmissionHolds(max_tokens=100, max_age_s=5.0)
    h.hold("a", "lock-a", 30, now=0.0)
    h.hold("b", "lock-b", 20, now=1.0)
    assert h.clear("reset") == ["lock-a", "lock-b"]
    assert len(h) == 0 and h.tokens == 0 and h.room_for(100) and h.release("a", "admitted") is None
    assert h.snapshot()["reset"] == 2 and h.clear() == []


def test_holds_expire_oldest_first_and_only_past_their_age() -> None:
    h: AdmissionHolds[int] = AdmissionHolds(max_tokens=100, max_age_s=5.0)
    for i in range(4):
        h.hold(i, i, 10, now=float(i))
    assert h.expired(4.9) == []
    assert h.expired(6.5) == [0, 1]  # held at 0 and 1: 6.5 and 5.5 s old
    assert len(h) == 2 and h.tokens == 20 and h.counts["expired"] == 2
    assert h.release(0, "admitted") is None  # an expired hold's lock went back with it
    assert h.expired(100.0) == [2, 3] and h.tokens == 0


def test_hold_config_is_validated() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        AdmissionHolds(-1, 1.0)
    with pytest.raises(ValueError, match="max_age_s"):
        AdmissionHolds(10, 0.0)
    from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig

    with pytest.raises(ValueError, match="admission_hold_fraction"):
        KvTiersConfig(admission_hold_fraction=1.5)
    with pytest.raises(ValueError, match="admission_hold_max_s"):
        KvTiersConfig(admission_hold_max_s=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hold", "admit", "abort", "tick"]), st.integers(0, 7),
                          st.integers(1, 400)), max_size=60))
def test_random_interleavings_never_leak_or_double_release_a_lock(ops: list[tuple[str, int, int]]) -> None:
    """Every lock taken comes back exactly once (release, abort or expiry), tokens never go past the
    budget, and the token count is the sum of what is held."""
    h: AdmissionHolds[tuple[int, int]] = AdmissionHolds(max_tokens=1000, max_age_s=3.0)
    taken: set[tuple[int, int]] = set()
    returned: list[tuple[int, int]] = []
    live: dict[int, int] = {}
    now = 0.0
    for serial, (op, req, tokens) in enumerate(ops):
        if op == "hold":
            if req in h or not h.room_for(tokens):
                continue
            lock = (req, serial)
            h.hold(req, lock, tokens, now)
            taken.add(lock)
            live[req] = tokens
        elif op in ("admit", "abort"):
            lock = h.release(req, "admitted" if op == "admit" else "aborted")
            if lock is not None:
                returned.append(lock)
                live.pop(req)
        else:
            now += tokens / 100.0
            for lock in h.expired(now):
                returned.append(lock)
                live.pop(lock[0])
        assert 0 <= h.tokens <= h.max_tokens and h.tokens == sum(live.values()) and len(h) == len(live)
    for lock in h.expired(math.inf):
        returned.append(lock)
    assert len(returned) == len(set(returned)) and set(returned) == taken


def test_gate_l2_budget_counts_spans_waiting_for_admission_and_defers() -> None:
    g = PrefetchGate(max_inflight_ops=4, max_inflight_tokens=10_000)
    d = g.decide(1200, 100, 1, 1000, held_tokens=2000, l2_budget=4000)
    assert not d.admit and d.reason == "l2_budget" and d.deferred
    assert g.decide(1000, 100, 1, 1000, held_tokens=2000, l2_budget=4000).admit  # fits exactly
    assert g.decide(5000, 100, 0, 0, held_tokens=0, l2_budget=4000).admit  # idle: one oversized span
    assert not g.decide(5000, 100, 0, 0, held_tokens=1, l2_budget=4000).admit  # a held span is not idle
    assert g.decide(500, 100, 4, 0).deferred  # the in-flight bounds defer too
    refused = g.decide(50, 100, 0, 0)
    assert refused.reason == "recompute_cheaper" and not refused.deferred  # not worth it: never re-asked
    assert g.decide(10**9, 100, 0, 0).admit  # no L2 budget given: as before


def test_gate_never_admits_past_the_l2_budget_when_anything_waits() -> None:
    rng = random.Random(7)
    g = PrefetchGate(max_inflight_ops=8, max_inflight_tokens=1 << 30)
    for _ in range(2000):
        ops, inflight, held, cand = rng.randint(0, 7), rng.randint(0, 5000), rng.randint(0, 5000), rng.randint(1, 3000)
        if ops == 0:
            inflight = 0
        d = g.decide(cand, 1, ops, inflight, held_tokens=held, l2_budget=6000)
        if d.admit and (ops or held):
            assert inflight + held + cand <= 6000
