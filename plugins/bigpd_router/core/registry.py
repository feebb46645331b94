"""Layer: core (no SGLang import). The set of instances the router knows, with their state.

Instances join and leave at run time. Each has a role (plain, prefill or decode), a capacity
read from the instance itself, a health state driven by active checks and request outcomes, and
the router's own book-keeping of what it has sent there (in-flight requests, prefill tokens
that have not produced a first token yet). Removal is two-step: `start_drain` stops new
traffic, `remove` happens once in-flight work is gone (or a timeout says so).
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from kllm_plugins.plugins.bigpd_router.core.slo_load import RateEstimator

log = logging.getLogger("kllm.bigpd_router.registry")


class Role(str, enum.Enum):
    PLAIN = "plain"
    PREFILL = "prefill"
    DECODE = "decode"


class Health(str, enum.Enum):
    STARTING = "starting"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"


@dataclass
class InstanceLoad:
    """What the instance itself last reported (SGLang /v1/loads); zeros until first poll."""

    running_reqs: int = 0
    waiting_reqs: int = 0
    waiting_tokens: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    at: float = 0.0


@dataclass
class Instance:
    url: str
    role: Role
    capacity_tokens: int = 0
    """KV capacity in tokens (SGLang max_total_num_tokens); 0 when unknown."""
    bootstrap_port: int | None = None
    """PD bootstrap port of a prefill instance."""
    health: Health = Health.STARTING
    failures: int = 0
    in_flight: int = 0
    pending_prefill_tokens: int = 0
    """Prompt tokens routed here whose first token has not come back yet."""
    decoding: int = 0
    """Requests here that are past their first token."""
    reported: InstanceLoad = field(default_factory=InstanceLoad)
    prefill_rate: RateEstimator = field(default_factory=lambda: RateEstimator(initial=2000.0))
    """Prompt tokens per second served by this instance (measured from TTFTs)."""
    tpot: RateEstimator = field(default_factory=lambda: RateEstimator(initial=0.02))
    """Seconds per output token (measured from streams)."""
    ttft_recent: RateEstimator = field(default_factory=lambda: RateEstimator(initial=0.0, alpha=0.2))
    tpot_recent: RateEstimator = field(default_factory=lambda: RateEstimator(initial=0.0, alpha=0.2))
    joined_at: float = field(default_factory=time.monotonic)
    drain_started: float | None = None
    managed: bool = False
    """True when an actuator started this instance (so the controller may stop it)."""
    kv_events: dict[str, object] | None = None
    """The instance's KV-event publisher as /server_info describes it (None: it does not publish)."""
    tokenizer_path: str | None = None

    @property
    def routable(self) -> bool:
        return self.health is Health.HEALTHY

    def free_kv_fraction(self) -> float:
        if self.reported.at == 0.0:
            return 1.0
        return max(0.0, 1.0 - self.reported.token_usage)

    def snapshot(self) -> dict[str, object]:
        return {
            "url": self.url,
            "role": self.role.value,
            "health": self.health.value,
            "capacity_tokens": self.capacity_tokens,
            "bootstrap_port": self.bootstrap_port,
            "in_flight": self.in_flight,
            "pending_prefill_tokens": self.pending_prefill_tokens,
            "decoding": self.decoding,
            "prefill_tokens_per_s": round(self.prefill_rate.value, 3),
            "tpot_s": round(self.tpot.value, 6),
            "reported": {
                "running_reqs": self.reported.running_reqs,
                "waiting_reqs": self.reported.waiting_reqs,
                "waiting_tokens": self.reported.waiting_tokens,
                "token_usage": self.reported.token_usage,
            },
            "managed": self.managed,
            "kv_events": bool(self.kv_events),
        }


class Registry:
    """Thread-safe map url -> Instance. Listeners hear about joins and removals."""

    def __init__(self, health_failures: int = 2) -> None:
        self._by_url: dict[str, Instance] = {}
        self._lock = threading.RLock()
        self._health_failures = health_failures
        self._listeners: list[Callable[[str, Instance], None]] = []

    def subscribe(self, fn: Callable[[str, Instance], None]) -> None:
        """fn(event, instance) with event in {"join", "remove", "health"}."""
        self._listeners.append(fn)

    def _emit(self, event: str, inst: Instance) -> None:
        for fn in self._listeners:
            fn(event, inst)

    def add(self, inst: Instance) -> Instance:
        with self._lock:
            if inst.url in self._by_url:
                raise ValueError(f"instance {inst.url} is already registered")
            self._by_url[inst.url] = inst
        log.info("instance joined url=%s role=%s capacity_tokens=%d", inst.url, inst.role.value, inst.capacity_tokens)
        self._emit("join", inst)
        return inst

    def get(self, url: str) -> Instance | None:
        with self._lock:
            return self._by_url.get(url)

    def __contains__(self, url: object) -> bool:
        with self._lock:
            return url in self._by_url

    def __iter__(self) -> Iterator[Instance]:
        with self._lock:
            return iter(list(self._by_url.values()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_url)

    def pool(self, role: Role, *, routable_only: bool = False, include_draining: bool = False) -> list[Instance]:
        """Instances of one role. By default every member except draining ones."""
        with self._lock:
            out = []
            for inst in self._by_url.values():
                if inst.role is not role:
                    continue
                if routable_only and not inst.routable:
                    continue
                if inst.health is Health.DRAINING and not include_draining:
                    continue
                out.append(inst)
            return out

    def start_drain(self, url: str, now: float | None = None) -> Instance:
        with self._lock:
            inst = self._by_url[url]
            started = inst.health is not Health.DRAINING
            if started:
                inst.health = Health.DRAINING
                inst.drain_started = time.monotonic() if now is None else now
        log.info("instance draining url=%s in_flight=%d", url, inst.in_flight)
        if started:
            self._emit("health", inst)
        return inst

    def remove(self, url: str) -> Instance:
        with self._lock:
            inst = self._by_url.pop(url)
        log.info("instance removed url=%s", url)
        self._emit("remove", inst)
        return inst

    def mark_down(self, url: str, reason: str) -> None:
        """Liveness lost (probes unanswered, a request dropped): unhealthy now, not after more misses."""
        with self._lock:
            inst = self._by_url.get(url)
            if inst is None or inst.health in (Health.DRAINING, Health.UNHEALTHY, Health.STARTING):
                return
            before = inst.health
            inst.failures = max(inst.failures, self._health_failures)
            inst.health = Health.UNHEALTHY
        log.warning("instance health url=%s %s->unhealthy: %s", url, before.value, reason)
        self._emit("health", inst)

    def mark_check(self, url: str, ok: bool) -> None:
        """Record one health-check (or request) outcome; flips health after `health_failures` misses."""
        with self._lock:
            inst = self._by_url.get(url)
            if inst is None or inst.health is Health.DRAINING:
                return
            before = inst.health
            if ok:
                inst.failures = 0
                inst.health = Health.HEALTHY
            else:
                inst.failures += 1
                if inst.failures >= self._health_failures and inst.health is not Health.STARTING:
                    inst.health = Health.UNHEALTHY
            changed = before is not inst.health
        if changed:
            log.info("instance health url=%s %s->%s", url, before.value, inst.health.value)
            self._emit("health", inst)
