"""Layer: core (no SGLang import, no I/O). A pool of warm standby instances and its book-keeping.

A standby instance has been started and has finished its start-up (model loaded, memory pools
allocated, warmed up) but is not registered with the router, so it gets no traffic. A scale-up
promotes one (it only has to be registered: well under a second) instead of starting a process
cold (tens of seconds on a CPU, minutes on a GPU); a scale-down may hand a drained instance back
to the pool instead of stopping it. What this module holds:
- `StartTimes`: the measured time-to-serve of each path (cold start, promotion), moving averages
  with priors, so the choice between them is made on measurements;
- `StandbyPolicy`: how many standbys per pool, a memory budget that bounds them, whether
  scale-downs return instances to the pool;
- `StandbyPool`: members (warming or ready), the choice for one scale-up (promote a ready one,
  take a warming one that will be ready sooner than a cold start, or start cold), the refill
  count, and the instance-seconds spent in standby.
The actuator (`actuators/standby_actuator.py`) does the I/O: starts processes, checks health,
measures memory, and calls into this.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from kllm_plugins.plugins.bigpd_router.core.registry import Role

log = logging.getLogger("kllm.bigpd_router.standby")


class StandbyEmpty(RuntimeError):
    """No standby instance of the pool can be handed out (the caller falls back to a cold start)."""


class MovingTime:
    """An exponentially weighted mean of measured seconds, starting from a prior."""

    def __init__(self, prior_s: float, alpha: float = 0.3) -> None:
        if prior_s < 0 or not 0 < alpha <= 1:
            raise ValueError(f"need prior_s >= 0 and 0 < alpha <= 1, got {prior_s}, {alpha}")
        self.value = float(prior_s)
        self.alpha = alpha
        self.samples = 0

    def observe(self, seconds: float) -> None:
        if seconds < 0:
            return
        # the first measurement replaces the prior outright: priors are guesses, measurements are not
        self.value = seconds if self.samples == 0 else self.value + self.alpha * (seconds - self.value)
        self.samples += 1


@dataclass
class StartTimes:
    """Measured time-to-serve of the two ways to add an instance, per pool."""

    cold_prior_s: float = 30.0
    """Process start to healthy, before anything was measured (the CPU figure for SmolLM2-135M)."""
    promote_prior_s: float = 1.0
    """Promotion of a ready standby to registered and healthy, before anything was measured."""
    cold: dict[Role, MovingTime] = field(default_factory=dict)
    promote: dict[Role, MovingTime] = field(default_factory=dict)

    def cold_s(self, role: Role) -> float:
        return self.cold.setdefault(role, MovingTime(self.cold_prior_s)).value

    def promote_s(self, role: Role) -> float:
        return self.promote.setdefault(role, MovingTime(self.promote_prior_s)).value

    def observe_cold(self, role: Role, seconds: float) -> None:
        self.cold.setdefault(role, MovingTime(self.cold_prior_s)).observe(seconds)

    def observe_promote(self, role: Role, seconds: float) -> None:
        self.promote.setdefault(role, MovingTime(self.promote_prior_s)).observe(seconds)

    def snapshot(self) -> dict[str, dict[str, float]]:
        roles = set(self.cold) | set(self.promote)
        return {r.value: {"cold_s": round(self.cold_s(r), 3), "promote_s": round(self.promote_s(r), 3)}
                for r in sorted(roles, key=lambda r: r.value)}


@dataclass(frozen=True)
class StandbyPolicy:
    size: Mapping[Role, int] = field(default_factory=dict)
    """Standby instances kept per pool (pools not listed keep none)."""
    max_memory_bytes: int = 0
    """Upper bound on the memory all standbys together may hold (resident set of each instance's
    processes as measured when it became ready); 0: only `size` bounds the pool."""
    return_on_scale_down: bool = True
    """A drained instance goes back to the pool (when it is below `size` and within the budget)
    instead of being stopped."""
    refill: bool = True
    """Start new standbys to replace promoted ones. False: the pool is filled once at start and
    afterwards only by instances returned on scale-downs (a fixed number of processes)."""

    def __post_init__(self) -> None:
        for role, n in self.size.items():
            if n < 0:
                raise ValueError(f"size[{role.value}] must be >= 0, got {n}")
        if self.max_memory_bytes < 0:
            raise ValueError(f"max_memory_bytes must be >= 0, got {self.max_memory_bytes}")


class State(str, enum.Enum):
    WARMING = "warming"
    """Started, not healthy yet (or still warming up)."""
    READY = "ready"
    """Healthy and warmed up; can be promoted now."""


@dataclass
class Standby:
    url: str
    role: Role
    started_at: float
    """When the process was started (or, for a returned instance, when it came back)."""
    state: State = State.WARMING
    ready_at: float | None = None
    memory_bytes: int = 0
    entered_at: float = 0.0
    """When it entered the pool (for the standby instance-seconds)."""
    returned: bool = False


@dataclass(frozen=True)
class Choice:
    kind: str
    """"promote" (a ready standby), "wait" (a warming standby ready sooner than a cold start) or
    "cold" (start a new process)."""
    url: str | None
    expected_s: float
    """Expected seconds until the instance serves, by the measured times."""
    reason: str


class StandbyPool:
    """Members and decisions; thread-safe (the actuator's filler thread and the controller share it)."""

    def __init__(self, policy: StandbyPolicy, times: StartTimes | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.times = times or StartTimes()
        self.clock = clock
        self.members: dict[str, Standby] = {}
        self._lock = threading.RLock()
        self._standby_s = 0.0
        """Instance-seconds of members that have left the pool."""
        self.promoted = 0
        self.cold_fallbacks = 0
        self.returned = 0
        self.refused_for_memory = 0
        self._typical = 0
        """Largest measured memory of one instance."""
        self._started: dict[Role, int] = {}
        """Standbys started per pool (with refill off, at most `size` are ever started)."""

    # ------------------------------------------------------------------ membership
    def of(self, role: Role, state: State | None = None) -> list[Standby]:
        with self._lock:
            return [m for m in self.members.values() if m.role is role and (state is None or m.state is state)]

    def memory_bytes(self) -> int:
        """Memory held by the pool: measured per ready member; a warming one counts as a typical one."""
        with self._lock:
            return sum(m.memory_bytes or self._typical for m in self.members.values())

    def typical_memory_bytes(self) -> int:
        """Memory of one ready instance as measured (the largest seen), 0 while none was measured."""
        return self._typical

    def _fits(self, extra_bytes: int) -> bool:
        budget = self.policy.max_memory_bytes
        return not budget or self.memory_bytes() + extra_bytes <= budget

    def want(self, role: Role) -> int:
        """How many standbys of `role` to start now to reach the pool's size within the budget.
        With a budget and no instance measured yet, one at a time until one is."""
        with self._lock:
            missing = self.policy.size.get(role, 0) - len(self.of(role))
            if not self.policy.refill:
                missing = min(missing, self.policy.size.get(role, 0) - self._started.get(role, 0))
            if missing <= 0:
                return 0
            budget = self.policy.max_memory_bytes
            if not budget:
                return missing
            if not self._typical:
                return 0 if self.members else 1
            room = (budget - self.memory_bytes()) // self._typical
            return max(0, min(missing, int(room)))

    def add_warming(self, url: str, role: Role, now: float | None = None) -> Standby:
        now = self.clock() if now is None else now
        with self._lock:
            if url in self.members:
                raise ValueError(f"standby {url} is already in the pool")
            m = Standby(url, role, started_at=now, entered_at=now)
            self.members[url] = m
            self._started[role] = self._started.get(role, 0) + 1
        log.info("standby warming url=%s role=%s", url, role.value)
        return m

    def mark_ready(self, url: str, memory_bytes: int = 0, now: float | None = None) -> bool:
        """The standby at `url` answered its health check and is warmed up. Its start-up time is a
        measured cold start. False (and it leaves the pool) when it would break the memory budget:
        the caller stops it."""
        now = self.clock() if now is None else now
        with self._lock:
            m = self.members.get(url)
            if m is None or m.state is State.READY:
                return m is not None
            m.memory_bytes = memory_bytes
            self._typical = max(self._typical, memory_bytes)
            if self.policy.max_memory_bytes and self.memory_bytes() > self.policy.max_memory_bytes:
                self._leave(m, now)
                self.refused_for_memory += 1
                log.warning("standby url=%s needs %d bytes: over the pool budget %d, stopped", url, memory_bytes,
                            self.policy.max_memory_bytes)
                return False
            m.state, m.ready_at = State.READY, now
            if not m.returned:
                self.times.observe_cold(m.role, now - m.started_at)
        log.info("standby ready url=%s role=%s after %.1fs memory=%d", url, m.role.value, now - m.started_at,
                 memory_bytes)
        return True

    def drop(self, url: str, now: float | None = None) -> Standby | None:
        """Forget a member (it died or is being stopped)."""
        now = self.clock() if now is None else now
        with self._lock:
            m = self.members.get(url)
            if m is not None:
                self._leave(m, now)
            return m

    def _leave(self, m: Standby, now: float) -> None:
        self.members.pop(m.url, None)
        self._standby_s += max(0.0, now - m.entered_at)

    # ------------------------------------------------------------------ decisions
    def choose(self, role: Role, now: float | None = None) -> Choice:
        """How to add one instance of `role`, by the measured times."""
        now = self.clock() if now is None else now
        cold = self.times.cold_s(role)
        with self._lock:
            ready = self.of(role, State.READY)
            if ready:
                promote = self.times.promote_s(role)
                if promote < cold:
                    best = min(ready, key=lambda m: m.ready_at or 0.0)  # the longest-waiting one
                    return Choice("promote", best.url, promote,
                                  f"ready standby: promotion {promote:.2f}s < cold start {cold:.1f}s")
                return Choice("cold", None, cold, f"promotion {promote:.2f}s not faster than cold start {cold:.1f}s")
            warming = self.of(role, State.WARMING)
            if warming:
                best = max(warming, key=lambda m: now - m.started_at)  # the furthest along
                left = max(0.0, cold - (now - best.started_at))
                if left < cold:
                    return Choice("wait", best.url, left,
                                  f"standby warming for {now - best.started_at:.1f}s: ~{left:.1f}s left < cold "
                                  f"start {cold:.1f}s")
        return Choice("cold", None, cold, f"no {role.value} standby: cold start (~{cold:.1f}s)")

    def take(self, url: str, now: float | None = None) -> Standby:
        """Hand a member out (promotion); raises StandbyEmpty if it is gone."""
        now = self.clock() if now is None else now
        with self._lock:
            m = self.members.get(url)
            if m is None:
                raise StandbyEmpty(f"standby {url} is no longer in the pool")
            self._leave(m, now)
            self.promoted += 1
        log.info("standby promoted url=%s role=%s state=%s", url, m.role.value, m.state.value)
        return m

    def accept_return(self, url: str, role: Role, memory_bytes: int = 0, now: float | None = None) -> bool:
        """Should a drained instance of `role` go back to the pool (True: it is now a ready member)
        rather than be stopped?"""
        now = self.clock() if now is None else now
        with self._lock:
            if not self.policy.return_on_scale_down or url in self.members:
                return False
            if len(self.of(role)) >= self.policy.size.get(role, 0):
                return False
            if not self._fits(memory_bytes or self.typical_memory_bytes()):
                self.refused_for_memory += 1
                return False
            self.members[url] = Standby(url, role, started_at=now, state=State.READY, ready_at=now,
                                        memory_bytes=memory_bytes or self.typical_memory_bytes(), entered_at=now,
                                        returned=True)
            self.returned += 1
        log.info("standby returned url=%s role=%s", url, role.value)
        return True

    # ------------------------------------------------------------------ accounting
    def standby_seconds(self, now: float | None = None) -> float:
        """Instance-seconds spent in the pool so far (warming included: a warming process costs too)."""
        now = self.clock() if now is None else now
        with self._lock:
            return self._standby_s + sum(max(0.0, now - m.entered_at) for m in self.members.values())

    def snapshot(self, now: float | None = None) -> dict[str, object]:
        now = self.clock() if now is None else now
        with self._lock:
            return {
                "members": [{"url": m.url, "role": m.role.value, "state": m.state.value,
                             "memory_bytes": m.memory_bytes} for m in self.members.values()],
                "memory_bytes": self.memory_bytes(),
                "standby_seconds": round(self.standby_seconds(now), 1),
                "promoted": self.promoted, "cold_fallbacks": self.cold_fallbacks, "returned": self.returned,
                "refused_for_memory": self.refused_for_memory, "times": self.times.snapshot(),
            }
