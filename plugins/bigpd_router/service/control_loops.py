"""Layer: service (no SGLang import). The router's background loops.

Active health checks (and re-probing of instances that come up), polling of SGLang's
`/v1/loads`, removal of drained instances, the scaling controller (instances it adds are
checked at once, a promoted standby by its /server_info alone, so it serves without waiting for
the next health round), and
pruning of idle upstream connections. Each loop survives its own failures. The loops sleep on the
shared grid of `ticks` (one wake-up serves several), and the drain loop sleeps until a drain starts.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING

import aiohttp

from kllm_plugins.plugins.bigpd_router.core.registry import Health, Instance, Role
from kllm_plugins.plugins.bigpd_router.service.proxy import UPSTREAM_ERRORS
from kllm_plugins.plugins.bigpd_router.service.ticks import tick
from kllm_plugins.plugins.bigpd_router.service.upstream import parse_loads, probe

if TYPE_CHECKING:
    from kllm_plugins.plugins.bigpd_router.service.router import Router

log = logging.getLogger("kllm.bigpd_router.loops")
NET_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class ControlLoops:
    def __init__(self, router: Router) -> None:
        self.r = router
        self._drains: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def drain_started(self) -> None:
        """An instance started draining (from any thread): the drain loop looks at it now."""
        loop, ev = self._loop, self._drains
        if loop is None or ev is None or loop.is_closed():
            return
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            ev.set()
        else:
            loop.call_soon_threadsafe(ev.set)

    def start(self) -> list[asyncio.Task[None]]:
        r = self.r
        self._loop, self._drains = asyncio.get_running_loop(), asyncio.Event()
        tasks = [asyncio.create_task(self.health_loop())]
        if r.cfg.loads_interval_s > 0:
            tasks.append(asyncio.create_task(self.loads_loop()))
        if r.controller is not None and r.cfg.scale_interval_s > 0:
            tasks.append(asyncio.create_task(self.scale_loop()))
        else:
            tasks.append(asyncio.create_task(self.drain_loop()))
        return tasks

    async def stop(self, tasks: list[asyncio.Task[None]]) -> None:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _check(self, inst: Instance) -> None:
        session = self.r.session
        assert session is not None
        try:  # a plain GET over pooled connections: far cheaper than an aiohttp request
            status, _ = await self.r.proxy.get(inst.url, "/health", self._check_timeout_s())
            ok = status == 200
        except UPSTREAM_ERRORS:  # TimeoutError included (an OSError)
            ok = False
        if ok and (inst.health is Health.STARTING or (inst.role is Role.PREFILL and inst.bootstrap_port is None)):
            try:
                info = await probe(session, inst.url)
                inst.capacity_tokens = info["capacity_tokens"] or inst.capacity_tokens
                if inst.role is Role.PREFILL:  # by the router's role: /server_info keeps the launch role
                    inst.bootstrap_port = inst.bootstrap_port or info["bootstrap_port"]
                if info.get("kv_events") and not inst.kv_events:
                    inst.kv_events = info["kv_events"]
                    self.r.kv_feed.subscribe(inst)
            except ConnectionError:
                ok = False
        self.r.registry.mark_check(inst.url, ok)

    def _check_timeout_s(self) -> float:
        # generous on purpose: a busy instance answers /health late, and a false "down" costs more
        return max(5.0, self.r.cfg.health_interval_s)

    async def _admit(self, inst: Instance) -> None:
        """First check of an instance the controller just added. A promoted standby passed SGLang's
        /health (a generated token) when it became ready and its process is running: the
        /server_info probe (capacity, bootstrap port) is enough, which spares the >= 1 s that
        SGLang's /health takes (it polls its own probe once a second). Others get the full check."""
        how = getattr(self.r.actuator, "choices", {}).get(inst.url)
        if getattr(how, "kind", None) != "promote":
            return await self._check(inst)
        session = self.r.session
        assert session is not None
        try:
            info = await probe(session, inst.url)
        except ConnectionError:
            return await self._check(inst)
        inst.capacity_tokens = info["capacity_tokens"] or inst.capacity_tokens
        if inst.role is Role.PREFILL:
            inst.bootstrap_port = inst.bootstrap_port or info["bootstrap_port"]
        if info.get("kv_events") and not inst.kv_events:
            inst.kv_events = info["kv_events"]
            self.r.kv_feed.subscribe(inst)
        self.r.registry.mark_check(inst.url, True)

    async def health_loop(self) -> None:
        r = self.r
        while True:
            await asyncio.gather(*(self._check(i) for i in r.registry), return_exceptions=True)
            r.update_gauges()
            r.proxy.pool.prune()
            r.proxy.probes.prune()
            await tick(r.cfg.health_interval_s)

    async def _poll(self, inst: Instance, timeout: aiohttp.ClientTimeout) -> None:
        session = self.r.session
        assert session is not None
        try:
            async with session.get(inst.url + "/v1/loads?include=core,memory", timeout=timeout) as resp:
                if resp.status != 200:
                    return
                loads = parse_loads(await resp.json(content_type=None))
        except (*NET_ERRORS, json.JSONDecodeError):
            return
        rep = inst.reported
        rep.running_reqs, rep.waiting_reqs = int(loads["running"]), int(loads["waiting"])
        rep.waiting_tokens = int(loads["waiting_tokens"])
        rep.token_usage = loads["used"] / loads["total"] if loads["total"] else 0.0
        rep.gen_throughput, rep.at = loads["gen"], time.monotonic()
        if loads["total"] and not inst.capacity_tokens:
            inst.capacity_tokens = int(loads["total"])

    async def loads_loop(self) -> None:
        r = self.r
        timeout = aiohttp.ClientTimeout(total=max(1.0, r.cfg.loads_interval_s * 2))
        while True:
            await asyncio.gather(*(self._poll(i, timeout) for i in r.registry if i.routable), return_exceptions=True)
            await tick(r.cfg.loads_interval_s)

    async def drain_loop(self) -> None:
        """Without the scaling loop: remove drained instances once their in-flight requests are done
        (through the controller when there is one, so a drain before a role switch ends in the switch).
        With no controller and nothing draining it sleeps until a drain starts (`drain_started`)."""
        r = self.r
        wake = self._drains
        assert wake is not None
        while True:
            if r.controller is not None:
                try:
                    await asyncio.to_thread(r.controller.finish_drains)
                except Exception:  # a failing actuator must not kill the router
                    log.exception("finishing drains failed")
                await tick(0.2)
                continue
            wake.clear()
            now = time.monotonic()
            draining = False
            for inst in list(r.registry):
                if inst.health is not Health.DRAINING or inst.drain_started is None:
                    continue
                if inst.in_flight == 0 or now - inst.drain_started >= r.cfg.drain_timeout_s:
                    r.registry.remove(inst.url)
                    if inst.managed and r.actuator is not None:
                        await asyncio.to_thread(r.actuator.remove, inst.url, inst.role)
                else:
                    draining = True
            if draining:
                await tick(0.2)
            else:
                await wake.wait()

    async def scale_loop(self) -> None:
        r = self.r
        assert r.controller is not None
        discover = getattr(r.actuator, "discover", None)
        # one period before the first decision: instances given at start-up are registered after the
        # loops start, and an empty pool would otherwise look "below minimum" and start servers
        await asyncio.sleep(r.cfg.scale_interval_s)
        while True:
            try:
                if callable(discover):  # e.g. Kubernetes: pods join once they are Ready
                    for role in r.controller.deciders:
                        for url in await asyncio.to_thread(discover, role):
                            if url not in r.registry:
                                inst = await r.add_instance(url, role, managed=True)
                                log.info("discovered instance url=%s role=%s", inst.url, role.value)
                before = {i.url for i in r.registry}
                decisions = await asyncio.to_thread(r.controller.step)
                # an instance added by this step may be serving already (a promoted standby): check
                # it now rather than at the next health round, so it takes traffic at once
                joined = [i for i in r.registry if i.url not in before and i.health is Health.STARTING]
                await asyncio.gather(*(self._admit(i) for i in joined), return_exceptions=True)
                for d in decisions:
                    if d.action != "hold":
                        r.metrics.scale_actions.labels(d.role.value, d.action).inc()
            except Exception:  # a failing actuator must not kill the router
                log.exception("scaling step failed")
            await tick(r.cfg.scale_interval_s)
