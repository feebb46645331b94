"""Layer: core (no SGLang import). Scaling controller: one independent decision per pool.

Each pool (prefill, decode, or plain) is scaled on its own SLO Load:
- up when Load has stayed above `up_load` for `up_sustain_s` (or the pool is below its minimum);
- down when the Load the pool *would* have with one instance fewer has stayed below `down_load`
  for `down_sustain_s`, so removing one does not immediately push it back over the top;
- never twice within `cooldown_s` on the same pool, never outside [min, max], and instances that
  are still starting count toward the size so a slow start does not trigger a second one;
- optionally ahead of time: the predicted Load (queue backlog over measured rates) extrapolated
  along its recent slope for `trend_lookahead_s` (about an instance's start-up time) also counts
  as high, so a growing queue starts an instance before the target is crossed;
- optionally a longer wait before removals: no scale-down within `down_after_up_s` of the pool's
  last scale-up (a shift that just happened tends to last).
A removal drains first: the instance stops getting traffic, and it is stopped once its
in-flight requests are done or the drain times out.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

from kllm_plugins.plugins.bigpd_router.core.registry import Health, Instance, Registry, Role
from kllm_plugins.plugins.bigpd_router.core.slo_load import PoolLoad

log = logging.getLogger("kllm.bigpd_router.scaling")

MIN_EXCESS = 0.1
"""Load above the floor (in units of the target) below which more instances would not help."""


class Actuator(Protocol):
    """What the controller needs from the thing that really starts and stops instances. An
    actuator may also offer `standby_seconds(now) -> float` (instance-seconds of instances it keeps
    started but unregistered, e.g. a standby pool), counted in `ScalingController.instance_seconds`."""

    def add(self, role: Role) -> str | None:
        """Start one instance of `role`. Return its URL when known now (it joins as STARTING)."""

    def remove(self, url: str, role: Role) -> None:
        """Stop the (drained) instance at `url`."""


COUNTERPART = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL}
"""An actuator may also offer `switch(url, old_role, new_role) -> bool`: flip an idle instance
between the PD pools (SGLang's /pd_role_switch) instead of stopping one and starting another."""


@dataclass(frozen=True)
class ScalePolicy:
    up_load: float = 0.9
    down_load: float = 0.4
    up_sustain_s: float = 10.0
    down_sustain_s: float = 60.0
    cooldown_s: float = 30.0
    min_instances: int = 1
    max_instances: int = 4
    drain_timeout_s: float = 120.0
    urgent_load: float = 0.0
    """Predicted Load (queue backlog over measured rates) above which the pool scales up at once,
    without waiting for up_sustain_s: a backlog is not noise. 0 turns this off."""
    trend_lookahead_s: float = 0.0
    """Seconds ahead to extrapolate the predicted Load along its least-squares slope over
    trend_window_s; the projection counts as high Load and sizes the step. 0 turns this off."""
    trend_window_s: float = 15.0
    """Window of predicted-Load samples the slope is fitted on."""
    down_after_up_s: float = 0.0
    """No scale-down within this many seconds after the pool's last scale-up."""

    def __post_init__(self) -> None:
        for name in ("trend_lookahead_s", "trend_window_s", "down_after_up_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.trend_lookahead_s and not self.trend_window_s:
            raise ValueError("trend_window_s must be > 0 when trend_lookahead_s is set")
        if self.urgent_load and self.urgent_load <= self.up_load:
            raise ValueError(f"urgent_load must be 0 or > up_load, got {self.urgent_load}")
        if not 0 <= self.down_load < self.up_load:
            raise ValueError(f"down_load must be in [0, up_load), got {self.down_load}")
        if self.min_instances < 0 or self.max_instances < max(1, self.min_instances):
            raise ValueError(f"need 0 <= min_instances <= max_instances, got {self.min_instances}, {self.max_instances}")


@dataclass(frozen=True)
class Decision:
    role: Role
    action: str  # "up", "down" or "hold"
    reason: str
    load: float
    size: int
    count: int = 1
    """How many instances to add or remove."""
    at: float = 0.0
    """Clock value when the decision was made."""


@dataclass
class _PoolState:
    above_since: float | None = None
    below_since: float | None = None
    last_action: float = -1e18
    last_up: float = -1e18
    samples: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)
    """(time, predicted Load) samples inside the trend window."""


def slope(samples: "collections.deque[tuple[float, float]] | list[tuple[float, float]]") -> float:
    """Least-squares slope (Load per second) of (time, load) samples; 0 with fewer than 3 or no spread."""
    n = len(samples)
    if n < 3:
        return 0.0
    mt = sum(t for t, _ in samples) / n
    ml = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var <= 0:
        return 0.0
    return sum((t - mt) * (v - ml) for t, v in samples) / var


class PoolDecider:
    """Pure decision logic for one pool; no I/O, a clock is passed in for tests."""

    def __init__(self, role: Role, policy: ScalePolicy) -> None:
        self.role = role
        self.policy = policy
        self.state = _PoolState()

    def spare(self, load: PoolLoad, size: int) -> bool:
        """Could the pool give one instance away now (the "low" test of a scale-down, without the
        sustain)? Used to lend an instance to the other PD pool by switching its role."""
        p = self.policy
        if size <= p.min_instances:
            return False
        after_down = load.load_with(size - 1)
        down_at = max(p.down_load, (min(load.floor_load, p.up_load) + p.up_load) / 2)
        return after_down < down_at or after_down - load.floor_load < MIN_EXCESS / 2

    def projected(self, load: PoolLoad, now: float) -> PoolLoad:
        """The load with its predicted part extrapolated along the recent trend (rising only); the
        same load when the trend is off. The samples restart after each scaling action of the pool
        (the slope was measured on the old size)."""
        p, st = self.policy, self.state
        if not p.trend_lookahead_s:
            return load
        st.samples.append((now, load.pred_load))
        while st.samples and st.samples[0][0] < now - p.trend_window_s:
            st.samples.popleft()
        rise = max(0.0, slope(st.samples)) * p.trend_lookahead_s
        return dataclasses.replace(load, pred=load.pred + rise * load.target) if rise else load

    def decide(self, load: PoolLoad, size: int, now: float) -> Decision:
        p, st = self.policy, self.state
        ahead = self.projected(load, now)
        cur = load.load
        after_down = load.load_with(size - 1)
        # hysteresis band: never ask for less than halfway between the floor and the up threshold,
        # or a pool whose idle latency is already near its target could never shrink
        down_at = max(p.down_load, (min(load.floor_load, p.up_load) + p.up_load) / 2)
        # only the part of the Load above the floor responds to instance count: a pool whose idle
        # latency already misses the target is not helped by more instances, and one that would stay
        # at its floor with one instance fewer is idle enough to shrink
        floor = load.floor_load
        top = max(cur, ahead.pred_load)
        high = top > p.up_load and top - floor > MIN_EXCESS
        low = after_down < down_at or after_down - floor < MIN_EXCESS / 2
        st.above_since = (st.above_since if st.above_since is not None else now) if high else None
        st.below_since = (st.below_since if st.below_since is not None else now) if low else None
        cooling = now - st.last_action < p.cooldown_s

        def out(action: str, reason: str, count: int = 1) -> Decision:
            d = Decision(self.role, action, reason, cur, size, count, now)
            if action != "hold":
                st.last_action = now
                st.above_since = st.below_since = None
                st.samples.clear()  # the slope was of the old size
                if action == "up":
                    st.last_up = now
            return d

        if size < p.min_instances:
            return out("up", f"size {size} below minimum {p.min_instances}", p.min_instances - size)
        if size > p.max_instances:
            return out("down", f"size {size} above maximum {p.max_instances}", size - p.max_instances)
        urgent_pred = ahead.pred_load
        urgent = bool(p.urgent_load) and urgent_pred > p.urgent_load and urgent_pred - floor > MIN_EXCESS
        if cooling:
            return out("hold", "cool-down")
        if st.above_since is not None and (urgent or now - st.above_since >= p.up_sustain_s):
            if size >= p.max_instances:
                return out("hold", f"load {cur:.2f} high but at maximum {p.max_instances}")
            # size the step on the prediction (the measured part lags behind earlier additions):
            # the smallest n whose predicted load is under the threshold, at most doubling
            want = size + 1
            while want < min(p.max_instances, 2 * max(size, 1)) and ahead.load_with(want, pred_only=True) > p.up_load:
                want += 1
            why = (f"predicted load {urgent_pred:.2f} > urgent {p.urgent_load}" if urgent
                   else f"load {top:.2f} > {p.up_load} for {now - st.above_since:.0f}s")
            return out("up", why, want - size)
        if (st.below_since is not None and now - st.below_since >= p.down_sustain_s and size > p.min_instances
                and now - st.last_up >= p.down_after_up_s):
            return out("down", f"load with {size - 1} would be {after_down:.2f} < {down_at:.2f}")
        return out("hold", f"load {cur:.2f}")


class ScalingController:
    """Runs the deciders against the registry and carries decisions out through an actuator."""

    def __init__(self, registry: Registry, actuator: Actuator, policy: ScalePolicy | Mapping[Role, ScalePolicy],
                 pool_load: Callable[[Role], PoolLoad], roles: tuple[Role, ...],
                 clock: Callable[[], float] = time.monotonic, role_switch: bool = False) -> None:
        self.role_switch = role_switch and callable(getattr(actuator, "switch", None))
        self.switching: dict[str, Role] = {}
        """Instances draining before a role switch -> the pool they will join."""
        self.registry = registry
        self.actuator = actuator
        policies = {r: policy for r in roles} if isinstance(policy, ScalePolicy) else dict(policy)
        missing = [r.value for r in roles if r not in policies]
        if missing:
            raise ValueError(f"no scaling policy for pools {missing}")
        self.policies = policies
        """Per pool: the same policy, or one per pool (e.g. different minimums)."""
        self.pool_load = pool_load
        self.deciders = {r: PoolDecider(r, policies[r]) for r in roles}
        self.clock = clock
        self.decisions: list[Decision] = []
        self._serving_since: dict[str, float] = {}
        """Instances this controller added -> when (their serving instance-seconds run from there)."""
        self._serving_s = 0.0

    def instance_seconds(self, now: float | None = None) -> dict[str, float]:
        """Instance-seconds of what this controller manages: instances it added, from the add to
        their stop (starting and draining time included), plus the actuator's standby time."""
        now = self.clock() if now is None else now
        serving = self._serving_s + sum(max(0.0, now - t) for t in self._serving_since.values())
        fn = getattr(self.actuator, "standby_seconds", None)
        standby = float(fn(now)) if callable(fn) else 0.0
        return {"serving": serving, "standby": standby, "total": serving + standby}

    def _stopped(self, url: str) -> None:
        since = self._serving_since.pop(url, None)
        if since is not None:
            self._serving_s += max(0.0, self.clock() - since)

    def size(self, role: Role) -> int:
        """Members counted for scaling: healthy and starting ones, and those switching into the pool."""
        return sum(1 for i in self.registry.pool(role) if i.health in (Health.HEALTHY, Health.STARTING)) + sum(
            1 for r in self.switching.values() if r is role)

    def finish_drains(self) -> list[str]:
        """Stop drained instances whose in-flight work is done (or whose drain timed out)."""
        now = self.clock()
        stopped = []
        for inst in list(self.registry):
            if inst.health is not Health.DRAINING or inst.drain_started is None:
                continue
            policy = self.policies.get(inst.role) or next(iter(self.policies.values()))
            timed_out = now - inst.drain_started >= policy.drain_timeout_s
            if inst.in_flight == 0 or timed_out:
                if timed_out and inst.in_flight:
                    log.warning("drain timed out url=%s in_flight=%d", inst.url, inst.in_flight)
                self.registry.remove(inst.url)
                target = self.switching.pop(inst.url, None)
                if target is not None:
                    self._switch(inst, target)
                    continue
                if inst.managed:
                    self.actuator.remove(inst.url, inst.role)
                    self._stopped(inst.url)
                stopped.append(inst.url)
        return stopped

    def _switch(self, inst: Instance, target: Role) -> None:
        """The drained instance flips role and joins the other pool (as STARTING: the health loop
        re-reads its role and bootstrap port); if the flip fails it rejoins its own pool."""
        ok = False
        try:
            ok = bool(self.actuator.switch(inst.url, inst.role, target))  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - an actuator failure must not stop the controller
            log.exception("role switch failed url=%s", inst.url)
        role = target if ok else inst.role
        log.info("role switch url=%s %s->%s ok=%s", inst.url, inst.role.value, target.value, ok)
        self.registry.add(Instance(url=inst.url, role=role, managed=inst.managed,
                                   capacity_tokens=inst.capacity_tokens))

    def start_switch(self, url: str, target: Role, now: float | None = None) -> bool:
        """Drain the instance at `url` and, once idle, flip it to the `target` PD pool (the lending
        path below, or an operator's request). False when it cannot: no switching actuator, not a
        healthy PD instance, already in that pool or already switching."""
        inst = self.registry.get(url)
        if (not self.role_switch or inst is None or target not in COUNTERPART or inst.role is target
                or inst.role not in COUNTERPART or url in self.switching or inst.health is not Health.HEALTHY):
            return False
        self.registry.start_drain(url, self.clock() if now is None else now)
        self.switching[url] = target
        log.info("switch role=%s->%s drain=%s", inst.role.value, target.value, url)
        return True

    def _lend(self, role: Role, count: int, now: float) -> int:
        """Take up to `count` instances from the counterpart pool while it has one to spare."""
        other = COUNTERPART.get(role)
        lent = 0
        if not self.role_switch or other is None or other not in self.deciders:
            return 0
        while lent < count and self.deciders[other].spare(self.pool_load(other), self.size(other)):
            ready = [i for i in self.registry.pool(other) if i.health is Health.HEALTHY]
            if not ready:
                break
            victim = min(ready, key=lambda i: (i.in_flight, -i.joined_at))  # the idlest drains fastest
            if not self.start_switch(victim.url, role, now):
                break
            lent += 1
        return lent

    def pick_victim(self, role: Role) -> Instance | None:
        members = [i for i in self.registry.pool(role) if i.health in (Health.HEALTHY, Health.STARTING)]
        managed = [i for i in members if i.managed]
        cands = managed or members
        if not cands:
            return None
        # unhealthy/starting first, then the least busy, newest last-in first-out on ties
        return min(cands, key=lambda i: (i.health is Health.HEALTHY, i.in_flight, -i.joined_at))

    def step(self) -> list[Decision]:
        self.finish_drains()
        now = self.clock()
        made = []
        for role, decider in self.deciders.items():
            d = decider.decide(self.pool_load(role), self.size(role), now)
            if d.action == "up":
                for _ in range(d.count - self._lend(role, d.count, now)):
                    url = self.actuator.add(role)
                    if url is not None and url not in self.registry:
                        self.registry.add(Instance(url=url, role=role, managed=True))
                        self._serving_since.setdefault(url, now)
                    how = getattr(self.actuator, "choices", {}).get(url)
                    log.info("scale up role=%s reason=%s url=%s how=%s", role.value, d.reason, url,
                             how.kind if how is not None else "start")
            elif d.action == "down":
                for _ in range(d.count):
                    victim = self.pick_victim(role)
                    if victim is None:
                        break
                    self.registry.start_drain(victim.url, now)
                    log.info("scale down role=%s reason=%s drain=%s", role.value, d.reason, victim.url)
            made.append(d)
        self.decisions.extend(d for d in made if d.action != "hold")
        return made
