"""Layer: core of the kv_tiers plugin (no SGLang import). Device-side timings of asynchronous copies.

HiCache issues its L1->L2 backups without waiting for them, so a wall clock around the call times
the issuing, not the copy. The adapter records a start and an end event on the copy's stream
around each call (CUDA events with timing) and hands the pair here; a pair is read once its end
event has completed, at a later call, so nothing ever waits on the device.

An event is anything with `query() -> bool` (completed) and `elapsed_time(end) -> float`
(milliseconds from this event to `end`): torch.cuda.Event, or a stand-in in tests.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Protocol


class TimingEvent(Protocol):
    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class PendingTimings:
    """Copies in flight with their events and what each moved (any value, e.g. tokens and bytes);
    `ready()` returns the completed ones as (seconds, that value), oldest first. At most `limit` pairs wait: beyond that the oldest is dropped (and
    counted), so a stream that never completes cannot grow it."""

    def __init__(self, limit: int = 256) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self.dropped = 0
        self._pending: deque[tuple[TimingEvent, TimingEvent, Any]] = deque()

    def add(self, start: TimingEvent, end: TimingEvent, moved: Any) -> None:
        if len(self._pending) >= self.limit:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append((start, end, moved))

    def ready(self) -> list[tuple[float, Any]]:
        """The pairs whose end has completed, in issue order (a stream completes in order, so the
        first pending one still running stops the scan)."""
        out: list[tuple[float, Any]] = []
        while self._pending and self._pending[0][1].query():
            start, end, moved = self._pending.popleft()
            out.append((start.elapsed_time(end) / 1e3, moved))
        return out

    def __len__(self) -> int:
        return len(self._pending)
