"""Layer: plugin core (no SGLang import). Selective persistence: which pages are worth writing to L3.

Stock HiCache writes every page that reaches host memory through to L3. Most of them are never
read back (a one-off prompt), and under load those writes compete with reads for the disk. Here
a page is written only once it has been *seen* `min_reuse` times: stored again after being
evicted and recomputed, or looked up in L3 and missed. That is second-hit admission (as CDN
caches do it), with the bar raised under pressure:

A lookup miss counts as a sighting only for a page offered before (see `note_lookup_miss`).
Pages of a request that extends a cached prefix are admitted at their first sighting
(`note_continuation`): conversations come back, one-off prompts mostly do not.

- capacity pressure: the store is fuller than `fill_high` (every admission evicts something);
- bandwidth pressure: the writer was busy more than `busy_high` of the recent wall time.

Each raises the required count by a factor of `pressure_factor`. Counts live in a bounded LRU
map, so memory stays bounded whatever the traffic. Pages are admitted as a leading run, since
an L3 lookup stops at the first missing page of a prefix.

With `write_all_below_pressure` (the plugin's default) a store with room and a writer with
bandwidth takes every page at its first sighting, as stock write-through does: an unwritten
page that comes back on another instance is a lost hit, and below pressure a write costs
nothing that matters. Selection starts with the first kind of pressure (`min_reuse`
sightings, continuations at their first) and tightens by `pressure_factor` with the second.
Measured on ShareGPT conversations whose next turn lands on the other instance: second-hit
admission without pressure kept more than half of the later-reused pages out of L3.

Write-all needs reuse to pay for itself: with `reuse_window` > 0 it is on only while one of the
last `reuse_window` requests (L3 lookups) reused something (extended a cached prefix or hit L3)
or a page was offered again. Without such a sign (at start, or a workload of one-off prompts)
the policy is *dormant*: it selects as under pressure (a page needs `min_reuse` sightings,
counted in memory; continuations their first), so a workload without reuse writes nothing to
L3 and leaves no offer markers. With `start_active` a fresh policy assumes reuse, as if its
window held one reused lookup: it writes everything (as stock write-through) until
`reuse_window` lookups in a row show none. Instances sharing a store mostly need that: a page
one instance held back while dormant is invisible to the others, and the first requests after
a start are where a restarted instance's neighbours look for its pages.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable


class ReuseCounter:
    """Sightings per key, bounded to `max_keys` (least recently seen keys are forgotten)."""

    def __init__(self, max_keys: int) -> None:
        if max_keys <= 0:
            raise ValueError(f"max_keys must be > 0, got {max_keys}")
        self.max_keys = max_keys
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def see(self, key: str) -> int:
        with self._lock:
            n = self._counts.pop(key, 0) + 1
            self._counts[key] = n
            if len(self._counts) > self.max_keys:
                self._counts.popitem(last=False)
            return n

    def count(self, key: str) -> int:
        with self._lock:
            return self._counts.get(key, 0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)


class BusyMeter:
    """Fraction of wall time spent in an activity, as an EWMA over `window_s`."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] | None = None) -> None:
        self.window_s = window_s
        self._clock = clock or time.monotonic
        self._last = self._clock()
        self._busy = 0.0
        self._lock = threading.Lock()

    def add(self, busy_s: float) -> None:
        with self._lock:
            self._decay()
            self._busy += busy_s

    def fraction(self) -> float:
        with self._lock:
            self._decay()
            return min(1.0, self._busy / self.window_s)

    def _decay(self) -> None:
        now = self._clock()
        dt = now - self._last
        if dt > 0:
            self._busy *= max(0.0, 1.0 - dt / self.window_s)
            self._last = now


@dataclass(frozen=True)
class Admission:
    admitted: int
    """Leading pages to write."""
    threshold: int
    """Sightings a page needed."""


class PersistencePolicy:
    def __init__(
        self,
        min_reuse: int = 2,
        fill_high: float = 0.9,
        busy_high: float = 0.5,
        pressure_factor: int = 2,
        max_keys: int = 200_000,
        write_all_below_pressure: bool = False,
        reuse_window: int = 0,
        start_active: bool = False,
    ) -> None:
        if min_reuse < 1:
            raise ValueError(f"min_reuse must be >= 1, got {min_reuse}")
        if not 0 < fill_high <= 1 or not 0 < busy_high <= 1:
            raise ValueError(f"fill_high and busy_high must be in (0, 1], got {fill_high}, {busy_high}")
        if pressure_factor < 1:
            raise ValueError(f"pressure_factor must be >= 1, got {pressure_factor}")
        if reuse_window < 0:
            raise ValueError(f"reuse_window must be >= 0, got {reuse_window}")
        self.min_reuse = min_reuse
        self.fill_high = fill_high
        self.busy_high = busy_high
        self.pressure_factor = pressure_factor
        self.write_all_below_pressure = write_all_below_pressure
        self.counter = ReuseCounter(max_keys)
        self.continuations = ReuseCounter(max_keys)
        self.reuse_window = reuse_window
        self._recent: deque[bool] = deque(maxlen=max(1, reuse_window))
        self._recent_reused = 0
        if start_active and reuse_window:
            # reuse is assumed at start, until `reuse_window` lookups in a row show none
            self._recent.append(True)
            self._recent_reused = 1
        self._reuse_lock = threading.Lock()

    def note_request(self, reused: bool) -> None:
        """One request's L3 lookup: whether it reused anything (a cached prefix or an L3 hit)."""
        with self._reuse_lock:
            if len(self._recent) == self._recent.maxlen and self._recent[0]:
                self._recent_reused -= 1
            self._recent.append(reused)
            self._recent_reused += int(reused)

    def reuse_seen(self) -> bool:
        """Whether one of the last `reuse_window` events showed reuse (always, with the window off)."""
        if self.reuse_window == 0:
            return True
        with self._reuse_lock:
            return self._recent_reused > 0

    def dormant(self) -> bool:
        """Write-all mode waiting for a sign of reuse: selection applies even without pressure."""
        return self.write_all_below_pressure and not self.reuse_seen()

    def pressure(self, fill: float, busy: float) -> int:
        """Kinds of pressure present: 0, 1 (capacity or bandwidth) or 2 (both)."""
        return int(fill >= self.fill_high) + int(busy >= self.busy_high)

    def threshold(self, fill: float, busy: float) -> int:
        """Sightings a page (not a continuation) needs at this fill and writer busy fraction."""
        level = self.pressure(fill, busy)
        if self.write_all_below_pressure:
            if level == 0:
                return 1 if self.reuse_seen() else self.min_reuse
            level -= 1
        return self.min_reuse * self.pressure_factor**level

    def note_lookup_miss(self, keys: list[str]) -> None:
        """Pages someone wanted from L3 and did not find: a sighting each, but only for pages
        already seen (offered for writing before). Every new request looks its uncached tail up
        in L3 first, so counting unknown pages would admit everything on first use."""
        for key in keys:
            if self.counter.count(key):
                self.counter.see(key)

    def note_continuation(self, keys: list[str]) -> None:
        """Pages about to be computed for a request that extends a cached prefix (a conversation's
        next turn, a shared system prompt's user part): admitted at their first sighting, since a
        request that itself reused a prefix is the kind whose pages come back. Pages of requests
        that reuse nothing still need `min_reuse` sightings."""
        for key in keys:
            self.continuations.see(key)

    def note_remote_sightings(self, keys: list[str], seen_elsewhere: list[bool]) -> None:
        """Pages another instance sharing the store offered before (and this one never saw): a
        sighting each, so that a page seen once on each of two instances is a second sighting."""
        for key, seen in zip(keys, seen_elsewhere):
            if seen and not self.counter.count(key):
                self.counter.see(key)

    def admit(self, keys: list[str], fill: float, busy: float) -> Admission:
        """Record a write attempt of `keys` (a sighting each) and return the leading run to write."""
        t = self.threshold(fill, busy)
        t_cont = max(1, t // self.min_reuse)  # the pressure factors still apply
        n = 0
        again = False
        for k in keys:
            c = self.counter.see(k)
            again |= c > 1
            if c < (t_cont if self.continuations.count(k) else t):
                break
            n += 1
        for k in keys[n + 1:]:  # sightings of the pages after the cut still count
            again |= self.counter.see(k) > 1
        if again and self.reuse_window:
            self.note_request(True)  # a page offered again: it came back (evicted and recomputed)
        return Admission(n, t)
