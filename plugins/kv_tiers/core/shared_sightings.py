"""Layer: plugin core (no SGLang import). Shared sightings over a remote key-value store.

Selective persistence writes a page to L3 at its `min_reuse`-th sighting. Instances that share
one L3 should count each other's sightings too, or a prefix seen once on each of two instances
is never written although it was reused. The file store does that with zero-byte files in its
folder; a distributed store (Mooncake) does it here with an *offer marker* per page: a tiny
object that says "some instance offered this page for writing before".

Per write batch: one batched existence check of the markers of the pages this instance has
never seen, then one batched put of the markers found missing; markers of pages that got written
are removed later in the background (a written page is found by lookups, its marker is noise).

The store is remote, so it may be slow or gone. Serving must not wait for it: the calls run on
one daemon thread, and the writer waits for the existence check at most `timeout_s`. A check
that is late, fails, or finds the thread still stuck in an earlier call leaves the batch's
sightings unshared (each page then needs its sightings on this instance, as without sharing),
counted by reason in `stats`. Pending removals are bounded; overflow is dropped (and counted):
a stale marker only makes a page's next sighting elsewhere count as its second.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Protocol

logger = logging.getLogger("kllm.kv_tiers")


class MarkerStore(Protocol):
    """The three batched calls the sightings need from a shared store."""

    def exists(self, keys: list[str]) -> list[int]:
        """Per key: 1 present, 0 absent, negative an error."""

    def mark(self, keys: list[str]) -> bool:
        """Put a marker object under each key; False if the store refused."""

    def unmark(self, keys: list[str]) -> None:
        """Remove the markers (missing ones are fine)."""


class _Check:
    __slots__ = ("keys", "done", "result", "cancelled")

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.done = threading.Event()
        self.result: list[bool] | None = None
        self.cancelled = False


class SharedSightings:
    """Offer markers of pages in a store shared by instances (see the module docstring).

    store:        the store's batched calls (exceptions are caught and counted).
    timeout_s:    how long a writer waits for the existence check of its batch.
    max_keys:     pages checked per batch (the rest of a larger batch stays unshared).
    max_pending:  marker removals waiting for the thread; beyond it they are dropped.
    on_unshared:  called as (reason, pages) each time sightings could not be shared.
    """

    REASONS = ("timeout", "busy", "error", "too_many")

    def __init__(self, store: MarkerStore, timeout_s: float = 0.05, max_keys: int = 1024,
                 max_pending: int = 65536, on_unshared: Callable[[str, int], None] | None = None) -> None:
        if timeout_s <= 0 or max_keys <= 0 or max_pending <= 0:
            raise ValueError(f"timeout_s, max_keys and max_pending must be > 0, got {timeout_s}, {max_keys}, "
                             f"{max_pending}")
        self.store = store
        self.timeout_s = timeout_s
        self.max_keys = max_keys
        self.max_pending = max_pending
        self.on_unshared = on_unshared
        self.stats: dict[str, int] = {"checked": 0, "seen_elsewhere": 0, "marked": 0, "unmarked": 0,
                                      "unmark_dropped": 0, **{f"unshared_{r}": 0 for r in self.REASONS}}
        self._cv = threading.Condition()
        self._checks: deque[_Check] = deque()
        self._removals: deque[str] = deque()
        self._busy_since: float | None = None  # when the thread's current store call began
        self._current: _Check | None = None  # the check that call serves, if any
        self._sharing = True
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kllm-kv-tiers-sightings", daemon=True)
        self._thread.start()

    # -- writer side -------------------------------------------------------------------------

    def note_offered(self, keys: list[str]) -> list[bool]:
        """For each key: whether some instance offered the page before (its marker exists);
        the missing markers are put afterwards. All False when the store does not answer in
        time (the sightings are then not shared; counted)."""
        if not keys:
            return []
        head, tail = keys[: self.max_keys], len(keys) - min(len(keys), self.max_keys)
        if tail:
            self._unshared("too_many", tail)
        with self._cv:
            # a call whose writer gave up, or older than the timeout: the store is stuck
            cur = self._current
            stuck = self._busy_since is not None and (
                (cur is not None and cur.cancelled) or time.monotonic() - self._busy_since > self.timeout_s)
            if stuck or len(self._checks) >= 2:
                reason = "busy"
                check = None
            else:
                check = _Check(head)
                self._checks.append(check)
                self._cv.notify()
        if check is None:
            self._unshared(reason, len(head))
            return [False] * len(keys)
        if not check.done.wait(self.timeout_s):
            with self._cv:  # the thread sets `done` under this lock: cancelled xor answered
                check.cancelled = not check.done.is_set()
            if check.cancelled:
                self._unshared("timeout", len(head))
                return [False] * len(keys)
        if check.result is None:
            self._unshared("error", len(head))
            return [False] * len(keys)
        self._shared()
        return check.result + [False] * tail

    def forget_offered(self, keys: list[str]) -> None:
        """Queue the removal of the markers of pages just written."""
        if not keys:
            return
        with self._cv:
            room = self.max_pending - len(self._removals)
            self._removals.extend(keys[: max(0, room)])
            dropped = len(keys) - max(0, room)
            if dropped > 0:
                self.stats["unmark_dropped"] += dropped
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until no check or removal is queued or running (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._checks or self._removals or self._busy_since is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    # -- outcome bookkeeping -----------------------------------------------------------------

    def _unshared(self, reason: str, n: int) -> None:
        with self._cv:
            self.stats[f"unshared_{reason}"] += n
            was, self._sharing = self._sharing, False
        if was:
            logger.warning("kv_tiers shared sightings: store did not answer (%s); sightings stay local until "
                           "it does (pages need their sightings on this instance)", reason)
        if self.on_unshared is not None:
            self.on_unshared(reason, n)

    def _shared(self) -> None:
        with self._cv:
            was, self._sharing = self._sharing, True
        if not was:
            logger.info("kv_tiers shared sightings: store answers again; sightings shared")

    # -- the store thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._checks or self._removals or self._closed):
                    self._cv.wait()
                if self._closed:
                    return
                # a check whose writer gave up still runs: its markers are for the other instances
                check = self._checks.popleft() if self._checks else None
                removals: list[str] = []
                if check is None:
                    while self._removals and len(removals) < self.max_keys:
                        removals.append(self._removals.popleft())
                self._busy_since = time.monotonic()
                self._current = check
            try:
                if check is not None:
                    self._check(check)
                else:
                    self._unmark(removals)
            finally:
                with self._cv:
                    self._busy_since = None
                    self._current = None
                    self._cv.notify_all()

    def _check(self, check: _Check) -> None:
        try:
            codes = self.store.exists(check.keys)
            if len(codes) != len(check.keys) or any(c < 0 for c in codes):
                raise RuntimeError(f"existence check answered {sorted(set(c for c in codes if c < 0))}")
        except Exception as exc:  # noqa: BLE001 - a store fault only makes the sightings local
            logger.debug("kv_tiers shared sightings: check failed (%s)", exc)
            with self._cv:
                check.done.set()
            return
        seen = [c == 1 for c in codes]
        with self._cv:
            self.stats["checked"] += len(seen)
            if not check.cancelled:
                check.result = seen
                self.stats["seen_elsewhere"] += sum(seen)
                check.done.set()
        missing = [k for k, s in zip(check.keys, seen) if not s]
        if not missing:
            return
        try:
            ok = self.store.mark(missing)
        except Exception as exc:  # noqa: BLE001
            logger.debug("kv_tiers shared sightings: marking failed (%s)", exc)
            ok = False
        if ok:
            with self._cv:
                self.stats["marked"] += len(missing)

    def _unmark(self, keys: list[str]) -> None:
        try:
            self.store.unmark(keys)
        except Exception as exc:  # noqa: BLE001
            logger.debug("kv_tiers shared sightings: removal failed (%s)", exc)
            return
        with self._cv:
            self.stats["unmarked"] += len(keys)
