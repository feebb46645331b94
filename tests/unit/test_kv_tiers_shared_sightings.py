"""kv_tiers core: `SharedSightings` (offer markers in a store shared by instances) against an
in-memory store that can be made to fail or to stall; no SGLang, no Mooncake."""
from __future__ import annotations

import threading

import pytest

from kllm_plugins.plugins.kv_tiers.core.persistence import PersistencePolicy
from kllm_plugins.plugins.kv_tiers.core.shared_sightings import SharedSightings


class _Store:
    """A marker store; `gate` (when set) holds every call until released, `fail` makes calls raise."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.calls: list[tuple[str, int]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.fail = False

    def _enter(self, op: str, n: int) -> None:
        self.calls.append((op, n))
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.fail:
            raise ConnectionError("master gone")

    def exists(self, keys: list[str]) -> list[int]:
        self._enter("exists", len(keys))
        return [int(k in self.keys) for k in keys]

    def mark(self, keys: list[str]) -> bool:
        self._enter("mark", len(keys))
        self.keys.update(keys)
        return True

    def unmark(self, keys: list[str]) -> None:
        self._enter("unmark", len(keys))
        self.keys.difference_update(keys)


def test_second_instance_sees_the_first_ones_offer_and_written_pages_lose_their_marker() -> None:
    store = _Store()
    a, b = SharedSightings(store, timeout_s=10), SharedSightings(store, timeout_s=10)
    assert a.note_offered(["p1", "p2"]) == [False, False]
    assert a.drain()
    assert store.keys == {"p1", "p2"}
    assert b.note_offered(["p2", "p3"]) == [True, False]
    assert b.drain() and store.keys == {"p1", "p2", "p3"}
    # one batched check and one batched put of the missing markers per call
    assert store.calls == [("exists", 2), ("mark", 2), ("exists", 2), ("mark", 1)]
    b.forget_offered(["p2"])
    assert b.drain() and store.keys == {"p1", "p3"}
    assert b.stats["seen_elsewhere"] == 1 and b.stats["unmarked"] == 1


def test_feeds_the_persistence_policy_as_a_second_sighting() -> None:
    store = _Store()
    a, b = SharedSightings(store, timeout_s=10), SharedSightings(store, timeout_s=10)
    pa, pb = PersistencePolicy(min_reuse=2), PersistencePolicy(min_reuse=2)
    keys = ["k1", "k2", "k3"]
    pa.note_remote_sightings(keys, a.note_offered(keys))
    assert pa.admit(keys, 0.0, 0.0).admitted == 0
    assert a.drain()
    pb.note_remote_sightings(keys, b.note_offered(keys))
    assert pb.admit(keys, 0.0, 0.0).admitted == 3
    lone = ["solo"]
    pb.note_remote_sightings(lone, b.note_offered(lone))
    assert pb.admit(lone, 0.0, 0.0).admitted == 0


def test_stalled_store_returns_within_the_timeout_then_skips_until_it_answers() -> None:
    store = _Store()
    store.gate = threading.Event()
    reasons: list[tuple[str, int]] = []
    s = SharedSightings(store, timeout_s=0.05, on_unshared=lambda r, n: reasons.append((r, n)))
    assert s.note_offered(["a", "b"]) == [False, False]  # the check is stuck in the store
    assert store.entered.wait(10)
    assert s.note_offered(["c"]) == [False]  # not queued behind a stuck call
    assert reasons == [("timeout", 2), ("busy", 1)]
    store.gate.set()
    assert s.drain(10)
    # the late answer is not used, but the markers still go in for the other instances
    assert store.keys == {"a", "b"} and s.stats["seen_elsewhere"] == 0
    s.timeout_s = 10
    assert s.note_offered(["a", "d"]) == [True, False]
    assert s.stats["unshared_timeout"] == 2 and s.stats["unshared_busy"] == 1


def test_failing_store_is_counted_never_raised() -> None:
    store = _Store()
    store.fail = True
    reasons: list[tuple[str, int]] = []
    s = SharedSightings(store, timeout_s=10, on_unshared=lambda r, n: reasons.append((r, n)))
    assert s.note_offered(["a", "b", "c"]) == [False] * 3
    s.forget_offered(["a"])
    assert s.drain()
    assert reasons == [("error", 3)] and s.stats["unmarked"] == 0
    store.fail = False
    assert s.note_offered(["a"]) == [False] and s.drain() and store.keys == {"a"}


def test_negative_codes_count_as_errors() -> None:
    class Down(_Store):
        def exists(self, keys: list[str]) -> list[int]:
            return [-900] * len(keys)

    s = SharedSightings(Down(), timeout_s=10)
    assert s.note_offered(["a"]) == [False]
    assert s.stats["unshared_error"] == 1


def test_cost_is_bounded() -> None:
    store = _Store()
    s = SharedSightings(store, timeout_s=10, max_keys=2, max_pending=3)
    assert s.note_offered(["a", "b", "c"]) == [False, False, False]
    assert s.drain() and store.keys == {"a", "b"} and s.stats["unshared_too_many"] == 1
    store.gate = threading.Event()
    store.entered.clear()
    s.forget_offered(["x"])  # the thread takes it and stalls
    assert store.entered.wait(10)
    s.forget_offered(["a", "b", "c", "d"])
    assert s.stats["unmark_dropped"] == 1
    store.gate.set()
    assert s.drain(10) and store.keys == set()
    assert [c for c in store.calls if c[0] == "unmark"] == [("unmark", 1), ("unmark", 2), ("unmark", 1)]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        SharedSightings(_Store(), timeout_s=0)
