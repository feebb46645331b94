"""Layer: service (no SGLang import). One task that watches every request in flight.

Timers per request would cost the request path a timer handle per read; instead each request
registers a `Watch` (its handler task, its client, its instance and its deadlines) and one loop
looks at all of them every `tick_s`. It ends a request, by cancelling its handler task with a
reason the proxy turns into the right answer, when:

- its client closed or reset the connection ("client": HTTP 499, the upstream request is aborted);
- the instance has sent nothing in time: no first byte by `first_deadline`, no further piece
  within `stall_s` of the last one, or the whole request past `deadline` ("timeout");
- its instance was marked down (liveness or health checks) and the request has no token yet,
  or its stream has been silent for longer than `down_grace_s` ("down").

With nothing in flight the loop sleeps until a request registers (no ticks while idle), and its
ticks fall on the `tick` grid that the background loops share, so one wake-up serves them all.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable

from kllm_plugins.plugins.bigpd_router.core.registry import Health, Instance
from kllm_plugins.plugins.bigpd_router.service.ticks import tick

if TYPE_CHECKING:
    from kllm_plugins.plugins.bigpd_router.service.front_server import Exchange
    from kllm_plugins.plugins.bigpd_router.service.upstream import Ticket

log = logging.getLogger("kllm.bigpd_router.watchdog")


class Watch:
    __slots__ = ("task", "ex", "inst", "ticket", "first_deadline", "deadline", "stall_s", "reason")

    def __init__(self, task: asyncio.Task[object], ex: Exchange) -> None:
        self.task = task
        self.ex = ex
        self.inst: Instance | None = None
        self.ticket: Ticket | None = None
        self.first_deadline = float("inf")
        self.deadline = float("inf")
        self.stall_s = float("inf")
        self.reason: str | None = None
        """Set when the watchdog ended the request: "client", "timeout" or "down"."""

    def arm(self, inst: Instance, ticket: Ticket, first_s: float, total_s: float, stall_s: float) -> None:
        """Watch one attempt on `inst` (the decode side in PD mode)."""
        self.inst, self.ticket = inst, ticket
        self.first_deadline = ticket.t0 + first_s
        self.deadline = ticket.t0 + total_s
        self.stall_s = stall_s

    def disarm(self) -> None:
        """Between attempts only the client is watched."""
        self.inst = self.ticket = None
        self.first_deadline = self.deadline = self.stall_s = float("inf")


class Watchdog:
    def __init__(self, tick_s: float = 0.1, down_grace_s: float = 1.0,
                 on_fire: Callable[[str], None] | None = None) -> None:
        self.tick_s = tick_s
        self.down_grace_s = down_grace_s
        self.on_fire = on_fire
        self.active: set[Watch] = set()
        self.fired: dict[str, int] = {"client": 0, "timeout": 0, "down": 0}
        self._busy: asyncio.Event | None = None
        """Set while requests are watched (made by `run`, in its loop)."""

    def add(self, w: Watch) -> None:
        active = self.active
        if not active and self._busy is not None:
            self._busy.set()
        active.add(w)

    def discard(self, w: Watch) -> None:
        active = self.active
        active.discard(w)
        if not active and self._busy is not None:
            self._busy.clear()

    def verdict(self, w: Watch, now: float) -> str | None:
        if w.ex.client_gone():
            return "client"
        t = w.ticket
        if t is None:
            return None
        if now >= w.deadline:
            return "timeout"
        last = t.t_last or t.t_first
        if t.t_first is None:
            if now >= w.first_deadline:
                return "timeout"
        elif last is not None and now - last >= w.stall_s:
            return "timeout"
        inst = w.inst
        if inst is not None and inst.health is Health.UNHEALTHY and (
                t.t_first is None or (last is not None and now - last >= self.down_grace_s)):
            return "down"
        return None

    def scan(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        n = 0
        for w in list(self.active):
            if w.reason is not None or w.task.done():
                continue
            reason = self.verdict(w, now)
            if reason is not None:
                w.reason = reason
                self.fired[reason] += 1
                if self.on_fire is not None:
                    self.on_fire(reason)
                w.task.cancel()
                n += 1
        return n

    async def run(self) -> None:
        busy = self._busy = asyncio.Event()
        if self.active:
            busy.set()
        while True:
            if not busy.is_set():
                await busy.wait()  # idle: no timer until a request is watched
            await tick(self.tick_s)
            try:
                self.scan()
            except Exception:  # the watchdog must outlive any one request
                log.exception("watchdog scan failed")
