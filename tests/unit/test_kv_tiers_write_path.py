"""Unit tests of kv_tiers' one L3 write path (core, no SGLang): both storage backends write
through `write_pages`, so what it does with skipped, held and shared pages holds for each."""
from __future__ import annotations

from dataclasses import dataclass, field

from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
from kllm_plugins.plugins.kv_tiers.core.tier_state import TierMeter, TierState
from kllm_plugins.plugins.kv_tiers.core.write_path import write_pages


@dataclass
class _Store:
    """An L3 store in memory: the `L3Writer` side, and `PageBatch`es over offered pages."""

    fill_fraction: float = 0.0
    shared: bool = False
    pages: dict[str, bytes] = field(default_factory=dict)
    offers: set[str] = field(default_factory=set)
    fail_at: int | None = None  # the batch write stops before this page

    def fill(self) -> float:
        return self.fill_fraction

    def note_offered(self, keys: list[str]) -> list[bool] | None:
        if not self.shared:
            return None
        seen = [k in self.offers for k in keys]
        self.offers.update(keys)
        return seen

    def forget_offered(self, keys: list[str]) -> None:
        self.offers.difference_update(keys)

    def put_held(self, key: str, data: bytes) -> bool:
        self.pages[key] = data
        return True

    def batch(self, keys: list[str]) -> "_Batch":
        return _Batch(self, keys)


@dataclass
class _Batch:
    store: _Store
    keys: list[str]
    copies: int = 0

    def write(self, n: int) -> int:
        for i, key in enumerate(self.keys[:n]):
            if self.store.fail_at == i:
                return i
            self.store.pages[key] = self.data(i)
        return n

    def copy(self, i: int) -> bytes | None:
        self.copies += 1
        return self.data(i)

    def data(self, i: int) -> bytes:
        return f"page:{self.keys[i]}".encode()


class _Meter(TierMeter):
    def __init__(self) -> None:
        self.pages_by: dict[str, int] = {}

    def pages(self, outcome: str, n: int = 1) -> None:
        self.pages_by[outcome] = self.pages_by.get(outcome, 0) + n


def _state(**cfg: object) -> tuple[TierState, _Meter]:
    meter = _Meter()
    return TierState(KvTiersConfig(**cfg), "test:1", meter), meter  # type: ignore[arg-type]


def _offer(t: TierState, store: _Store, keys: list[str]):
    return write_pages(t, store, keys, store.batch(keys))


DORMANT = {"start_active": False, "reuse_window": 4, "min_reuse": 2, "write_all_below_pressure": True}


def test_pages_skipped_while_dormant_are_held_and_written_once_reuse_is_seen() -> None:
    t, meter = _state(**DORMANT)
    store = _Store()
    out = _offer(t, store, ["a", "b", "c"])
    assert (out.admitted, out.skipped, out.written) == (0, 3, 0) and out.complete
    assert store.pages == {} and len(t.held) == 3 and t.persistence.dormant()
    t.note_lookup(["d"], 0, extends=True)  # a continuation: reuse is seen
    out = _offer(t, store, ["d"])
    assert out.written == 1
    assert store.pages == {k: f"page:{k}".encode() for k in "abcd"}  # the held copies, as offered
    assert t.counts["held_written"] == 3 and len(t.held) == 0
    assert meter.pages_by == {"skipped": 3, "written": 4}


def test_without_the_hold_dormant_pages_are_dropped_and_nothing_is_copied() -> None:
    t, _ = _state(**DORMANT, dormant_hold_mb=0)
    store = _Store()
    batch = store.batch(["a", "b"])
    write_pages(t, store, ["a", "b"], batch)
    assert batch.copies == 0 and len(t.held) == 0
    t.note_lookup(["x"], 0, extends=True)
    _offer(t, store, ["x"])
    assert set(store.pages) == {"x"} and "held_written" not in t.counts


def test_pages_skipped_for_pressure_are_not_held() -> None:
    """Held pages are the ones skipped before reuse is seen; under pressure a skipped page simply
    stays out (the store is full or the writer busy: more writes would not help)."""
    t, _ = _state(min_reuse=2, write_all_below_pressure=True, reuse_window=0)
    store = _Store(fill_fraction=0.95)
    out = _offer(t, store, ["a", "b"])
    assert out.skipped == 2 and len(t.held) == 0 and not t.persistence.dormant()


def test_a_page_offered_on_another_instance_counts_as_a_sighting_and_its_marker_goes_when_written() -> None:
    store = _Store(fill_fraction=0.95, shared=True)  # pressure: pages need two sightings
    a, _ = _state(min_reuse=2, reuse_window=0)
    assert _offer(a, store, ["p", "q"]).written == 0 and store.offers == {"p", "q"}
    b, _ = _state(min_reuse=2, reuse_window=0)  # another instance: its own policy, the same store
    assert _offer(b, store, ["p", "q"]).written == 2
    assert store.offers == set()  # written: the markers are removed


def test_a_failed_write_reports_the_pages_written_before_it() -> None:
    t, meter = _state(min_reuse=1, reuse_window=0)
    store = _Store(fail_at=1)
    out = _offer(t, store, ["a", "b", "c"])
    assert (out.admitted, out.written, out.complete) == (3, 1, False)
    assert t.counts["pages_admitted"] == 1 and meter.pages_by == {"written": 1}


def test_a_call_larger_than_the_hold_copies_only_the_pages_the_buffer_keeps() -> None:
    """A long prompt offers far more pages than the bounded buffer keeps: only its last pages are
    copied, and the buffer ends as if each had been held in turn."""
    page = len(b"page:k00")
    t, _ = _state(**DORMANT, dormant_hold_mb=3 * page / 2**20)
    store = _Store()
    first = [f"j{i:02d}" for i in range(2)]
    _offer(t, store, first)
    keys = [f"k{i:02d}" for i in range(40)]
    batch = store.batch(keys)
    out = write_pages(t, store, keys, batch)
    assert out.skipped == 40 and batch.copies == 3
    assert [k for k, _ in t.held.take_all()] == ["k37", "k38", "k39"]
    t2, _ = _state(**DORMANT, dormant_hold_mb=3 * page / 2**20)
    _offer(t2, store, first)
    _offer(t2, store, ["k00"])  # a short call: kept beside the older pages while they fit
    assert [k for k, _ in t2.held.take_all()] == ["j00", "j01", "k00"]
