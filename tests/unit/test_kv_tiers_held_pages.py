"""Unit tests of the pages held back while persistence is dormant (core, no SGLang)."""
from __future__ import annotations

import pytest

from kllm_plugins.plugins.kv_tiers.core.held_pages import HeldPages


def test_held_pages_are_bounded_oldest_dropped_first_and_taken_in_order() -> None:
    h = HeldPages(max_bytes=30)
    data = bytearray(b"a" * 10)
    assert h.hold("a", memoryview(data))
    data[:] = b"z" * 10  # a copy is held, not a view of the caller's buffer
    assert h.hold("b", b"b" * 10) and h.hold("c", b"c" * 10)
    assert h.hold("d", b"d" * 10)  # over the bound: "a" goes
    assert h.nbytes == 30 and h.dropped == 1
    assert h.hold("c", b"C" * 10)  # held again: one copy, now the newest
    assert len(h) == 3 and h.nbytes == 30
    assert h.take_all() == [("b", b"b" * 10), ("d", b"d" * 10), ("c", b"C" * 10)]
    assert len(h) == 0 and h.nbytes == 0 and h.take_all() == []


def test_page_larger_than_the_bound_is_not_held_and_zero_holds_nothing() -> None:
    h = HeldPages(max_bytes=8)
    assert not h.hold("big", b"x" * 9) and len(h) == 0
    assert h.hold("ok", b"x" * 8)
    none = HeldPages(max_bytes=0)
    assert not none.hold("k", b"x") and none.take_all() == []
    with pytest.raises(ValueError, match="max_bytes"):
        HeldPages(-1)
