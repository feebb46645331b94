"""Device timings of asynchronous copies: completed pairs are read in order, never waited for."""
from __future__ import annotations

import pytest

from kllm_plugins.plugins.kv_tiers.core.device_timings import PendingTimings


class Ev:
    def __init__(self, t_ms: float, done: bool = True) -> None:
        self.t_ms, self.done = t_ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "Ev") -> float:
        return end.t_ms - self.t_ms


def test_completed_pairs_come_out_in_order_and_a_running_one_waits() -> None:
    p = PendingTimings()
    p.add(Ev(0.0), Ev(4.0), 100)
    running = Ev(9.0, done=False)
    p.add(Ev(5.0), running, 200)
    p.add(Ev(10.0), Ev(11.0), 50)  # done, but behind a running copy on the same stream
    assert p.ready() == [(0.004, 100)]
    assert len(p) == 2 and p.ready() == []
    running.done = True
    assert p.ready() == [(0.004, 200), (0.001, 50)]
    assert len(p) == 0


def test_the_oldest_pair_is_dropped_beyond_the_limit() -> None:
    p = PendingTimings(limit=2)
    for i in range(3):
        p.add(Ev(0.0), Ev(1.0, done=False), i)
    assert len(p) == 2 and p.dropped == 1
    with pytest.raises(ValueError, match="at least 1"):
        PendingTimings(limit=0)
