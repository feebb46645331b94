"""A one-line progress bar for long benchmark runs: `Progress(total, label)`, `.step(note)` after
each unit of work, or `track(items, label)` around a loop. It writes `label [#####.....] 5/10 50% 1m20s, about 1m20s left: note` to stderr
(the results go to stdout), on one line rewritten in place on a terminal and one line per step
otherwise (a log file stays readable). The time left is the mean time per step so far times the
steps left. An injected clock makes it testable. SGLang-free.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Iterable, Iterator, Sized, TextIO, TypeVar

T = TypeVar("T")


def _dur(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    def __init__(self, total: int, label: str = "", width: int = 20, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total, self.label, self.width = total, label, width
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.start = clock()
        self.done = 0

    def line(self, note: str = "") -> str:
        elapsed = self.clock() - self.start
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(round(frac * self.width))
        left = elapsed / self.done * (self.total - self.done) if self.done else None
        eta = f", about {_dur(left)} left" if left is not None and self.done < self.total else ""
        text = f"{self.label} [{bar:.<{self.width}}] {self.done}/{self.total} {100 * frac:.0f}% {_dur(elapsed)}{eta}"
        return f"{text}: {note}" if note else text

    def step(self, note: str = "", n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        tty = getattr(self.stream, "isatty", lambda: False)()
        end = "\n" if not tty or self.done >= self.total else ""
        self.stream.write(("\r" if tty else "") + self.line(note) + end)
        self.stream.flush()


def track(items: Iterable[T], label: str = "", total: int | None = None, stream: TextIO | None = None) -> Iterator[T]:
    """Yields `items`, stepping a Progress after each (total: len(items) unless given)."""
    if total is None:
        total = len(items) if isinstance(items, Sized) else 0
    bar = Progress(total, label, stream=stream)
    for item in items:
        yield item
        bar.step()
