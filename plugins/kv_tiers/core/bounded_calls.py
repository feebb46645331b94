"""Layer: plugin core (no SGLang import). Bounded calls to a remote store that may stall.

A distributed L3 store (Mooncake) answers over RPC. When its master stalls (overloaded, paused,
a network partition that leaves TCP half-open), each call blocks until the client's RPC timeout,
about 30 s for Mooncake, and HiCache's storage threads block with it; under the
`wait_complete` prefetch policy every request behind them waits too. A slow store must cost a
miss, not a stall.

`BoundedCalls` runs a call that is safe to abandon (one that writes no memory the caller frees
afterwards: existence checks, removals) on a daemon thread of its own and waits for it at most
`timeout_s`; a late call raises `StoreSlow` and starts a *slow episode*. During an episode:
- a bounded call is refused at once while an earlier late call is still running (the store has
  not answered it yet), and otherwise goes through as a probe;
- an inline call (one that cannot be abandoned: a zero-copy read or write into the caller's
  buffers) is refused at once by `admit()`; `observe()` starts an episode when an inline call
  that did run took longer than `timeout_s`.
The first call begun during the episode that answers in time, without an error, ends it. One
WARNING at its start and one INFO at its end are logged (not one per call); `stats` counts
calls, late calls, refusals, episodes and unanswered tries.

`try_call` is for a caller that must not wait even `timeout_s` (the scheduler thread, deciding
whether to start a prefetch): it waits a shorter `wait_s`, one such call at a time, and a call
not answered by then raises `StoreSlow("pending")` without counting as late or starting an
episode; the calls that wait the full timeout (the lookups) judge the store.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

logger = logging.getLogger("kllm.kv_tiers")

T = TypeVar("T")


class StoreSlow(Exception):
    """The store did not answer in time ("timeout"), or is in a slow episode ("slow")."""

    def __init__(self, reason: str, op: str) -> None:
        super().__init__(f"store {reason} ({op})")
        self.reason = reason
        self.op = op


class _Call:
    __slots__ = ("done", "late", "value", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.late = False
        self.value: object = None
        self.error: BaseException | None = None


class BoundedCalls:
    """Deadline per store call and slow-episode bookkeeping (see the module docstring).

    timeout_s:  how long a caller waits for a bounded call, and the duration above which an
                inline call counts as late.
    name:       the store's name in log lines.
    max_late:   late calls still running beyond which no new thread is started even as a probe
                (each stuck call holds one thread until the store's own timeout frees it).
    """

    def __init__(self, timeout_s: float, name: str = "store", max_late: int = 2) -> None:
        if timeout_s <= 0 or max_late <= 0:
            raise ValueError(f"timeout_s and max_late must be > 0, got {timeout_s}, {max_late}")
        self.timeout_s = timeout_s
        self.name = name
        self.max_late = max_late
        self.stats: dict[str, int] = {"calls": 0, "late": 0, "refused": 0, "episodes": 0, "pending": 0}
        self._lock = threading.Lock()
        self._late_running = 0  # late bounded calls whose thread has not returned yet
        self._slow_since: float | None = None
        self._refused_in_episode = 0
        self._tried: _Call | None = None  # the `try_call` whose thread has not returned yet
        self._inside = threading.local()
        self._thread_name = f"kllm-{name.replace(' ', '-')}-call"

    @property
    def slow(self) -> bool:
        return self._slow_since is not None

    @property
    def pending(self) -> int:
        """Late calls whose thread is still inside the store."""
        return self._late_running

    # -- bounded calls -----------------------------------------------------------------------

    def call(self, op: str, fn: Callable[[], T]) -> T:
        """`fn()` on a thread of its own, waited for at most `timeout_s`. Raises `StoreSlow` when
        late or refused; an exception of `fn` is raised here. Nested calls (from inside a bounded
        call) run inline: they are already bounded."""
        if getattr(self._inside, "active", False):
            return fn()
        with self._lock:
            self._admit_call_locked(op)
        c = _Call()
        t0 = time.monotonic()
        threading.Thread(target=self._run, args=(c, fn), name=self._thread_name, daemon=True).start()
        if not c.done.wait(self.timeout_s):
            with self._lock:  # `_run` sets `done` under this lock: late xor answered
                late = c.late = not c.done.is_set()
                if late:
                    self._late_running += 1
                    self.stats["late"] += 1
                    self._start_episode_locked(op, f"no answer within {self.timeout_s * 1e3:.0f} ms")
            if late:
                raise StoreSlow("timeout", op)
        if c.error is not None:  # an answer, but not the store working again
            raise c.error
        self._answered(t0)
        return c.value  # type: ignore[return-value]

    def try_call(self, op: str, fn: Callable[[], T], wait_s: float) -> T:
        """`fn()` on a thread of its own, waited for at most `min(wait_s, timeout_s)`. Raises
        `StoreSlow("slow")` when refused as `call` is, `StoreSlow("pending")` when not answered by
        then or while the previous try is still unanswered (its thread then finishes on its own
        and its answer is dropped; nothing is counted late); an exception of `fn` is raised here."""
        if getattr(self._inside, "active", False):
            return fn()
        with self._lock:
            if self._tried is not None and not self._refusing_locked():
                self.stats["pending"] += 1
                raise StoreSlow("pending", op)
            self._admit_call_locked(op)
            c = self._tried = _Call()
        t0 = time.monotonic()
        threading.Thread(target=self._run, args=(c, fn, True), name=self._thread_name, daemon=True).start()
        if not c.done.wait(min(wait_s, self.timeout_s)):
            with self._lock:
                if not c.done.is_set():
                    self.stats["pending"] += 1
                    raise StoreSlow("pending", op)
        if c.error is not None:
            raise c.error
        self._answered(t0)
        return c.value  # type: ignore[return-value]

    def _refusing_locked(self) -> bool:
        return self._late_running >= self.max_late or (self._slow_since is not None and self._late_running > 0)

    def _admit_call_locked(self, op: str) -> None:
        if self._refusing_locked():
            self._refuse_locked()
            raise StoreSlow("slow", op)
        self.stats["calls"] += 1

    def _run(self, c: _Call, fn: Callable[[], object], tried: bool = False) -> None:
        self._inside.active = True
        try:
            c.value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, or dropped if late
            c.error = exc
        with self._lock:
            c.done.set()
            if c.late:  # its caller gave up on it; the store has answered at last
                self._late_running -= 1
            if tried:
                self._tried = None

    # -- inline calls ------------------------------------------------------------------------

    def admit(self, op: str) -> bool:
        """Whether an inline call may run now (False during a slow episode; counted)."""
        with self._lock:
            if self._slow_since is None:
                return True
            self._refuse_locked()
            return False

    def observe(self, op: str, seconds: float) -> None:
        """Record how long an inline call took: late starts an episode, in time ends one."""
        if seconds > self.timeout_s:
            with self._lock:
                self.stats["late"] += 1
                self._start_episode_locked(op, f"took {seconds * 1e3:.0f} ms")
        else:
            self._answered(time.monotonic() - seconds)

    # -- episodes ----------------------------------------------------------------------------

    def _refuse_locked(self) -> None:
        self.stats["refused"] += 1
        self._refused_in_episode += 1

    def _start_episode_locked(self, op: str, why: str) -> None:
        if self._slow_since is not None:
            return
        self._slow_since = time.monotonic()
        self._refused_in_episode = 0
        self.stats["episodes"] += 1
        logger.warning("kv_tiers %s slow: %s %s; L3 calls are skipped (misses, prefixes recomputed) until it "
                       "answers in time again", self.name, op, why)

    def _answered(self, started: float) -> None:
        """A call begun at `started` was answered in time: the end of an episode, unless the call
        began before the episode did (its answer says nothing about the store since)."""
        now = time.monotonic()
        seconds = now - started
        with self._lock:
            if self._slow_since is None or started < self._slow_since:
                return
            took = now - self._slow_since
            refused = self._refused_in_episode
            self._slow_since = None
        logger.info("kv_tiers %s back: answered in %.0f ms after %.1f s slow; %d calls skipped meanwhile",
                    self.name, seconds * 1e3, took, refused)
