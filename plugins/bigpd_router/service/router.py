"""Layer: service (no SGLang import). The router: its state, membership and lifecycle.

`Router` holds what the request path and the background loops share: the registry of
instances, the approximate prefix tree and the KV-event index, measured TTFT/TPOT, metrics and
the scaling controller. The request path lives in `proxy`, the other endpoints in `admin_api`,
the background loops in `control_loops`, the HTTP server in `front_server`.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any, AsyncIterator

import aiohttp

from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.input_limits import ModelLimits
from kllm_plugins.plugins.bigpd_router.core.kv_index import KvIndex
from kllm_plugins.plugins.bigpd_router.core.pairing import Picker
from kllm_plugins.plugins.bigpd_router.core.prefix_tree import Prompt, PrefixTree
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Instance, Registry, Role
from kllm_plugins.plugins.bigpd_router.core.request_shape import RequestShape
from kllm_plugins.plugins.bigpd_router.core.scaling import Actuator, ScalePolicy, ScalingController
from kllm_plugins.plugins.bigpd_router.core.slo_load import (
    PoolLoad,
    RateEstimator,
    TokenEstimator,
    WindowStat,
    decode_pool_load,
    prefill_pool_load,
)
from kllm_plugins.plugins.bigpd_router.service.admin_api import AdminApi
from kllm_plugins.plugins.bigpd_router.service.control_loops import ControlLoops
from kllm_plugins.plugins.bigpd_router.service.front_server import Exchange, FrontServer
from kllm_plugins.plugins.bigpd_router.service.kv_events import KvEventFeed
from kllm_plugins.plugins.bigpd_router.service.liveness import Liveness
from kllm_plugins.plugins.bigpd_router.service.proxy import ENDPOINTS, Proxy
from kllm_plugins.plugins.bigpd_router.service.router_metrics import RouterMetrics
from kllm_plugins.plugins.bigpd_router.service.upstream import fetch_limits, probe

log = logging.getLogger("kllm.bigpd_router.router")


class Router:
    def __init__(self, cfg: RouterConfig, actuator: Actuator | None = None,
                 scaled_roles: tuple[Role, ...] = ()) -> None:
        self.cfg = cfg
        self.registry = Registry(cfg.health_failures)
        self.tree = PrefixTree(cfg.affinity_block_chars, cfg.affinity_max_blocks)
        self.kv_index = KvIndex()
        self.kv_feed = KvEventFeed(self.kv_index, cfg.kv_events, cfg.tokenizer_path)
        self.picker = Picker(cfg.policy, self.tree, cfg.ttft_target_s, cfg.tpot_target_s, cfg.affinity_weight)
        self.tokens = TokenEstimator()
        self.typical_prompt = RateEstimator(initial=256.0, alpha=0.05)
        self.ttft_actual = {r: WindowStat(cfg.load_window_s) for r in Role}
        self.tpot_actual = {r: WindowStat(cfg.load_window_s) for r in Role}
        self.metrics = RouterMetrics()
        self.actuator = actuator
        self.controller: ScalingController | None = None
        if actuator is not None and scaled_roles:
            policy = ScalePolicy(cfg.scale_up_load, cfg.scale_down_load, cfg.scale_up_sustain_s,
                                 cfg.scale_down_sustain_s, cfg.scale_cooldown_s, cfg.min_instances,
                                 cfg.max_instances, cfg.drain_timeout_s, cfg.scale_urgent_load,
                                 trend_lookahead_s=cfg.scale_trend_lookahead_s,
                                 trend_window_s=cfg.scale_trend_window_s,
                                 down_after_up_s=cfg.scale_down_after_up_s)
            policies = {r: dataclasses.replace(policy, min_instances=cfg.pool_minimum(r.value)) for r in scaled_roles}
            self.controller = ScalingController(self.registry, actuator, policies, self.pool_load, scaled_roles,
                                                role_switch=cfg.scale_role_switch)
        self.registry.subscribe(self._on_registry_event)
        self.session: aiohttp.ClientSession | None = None
        """For probes and the background loops; the request path uses `proxy.pool`."""
        self.proxy = Proxy(self)
        self.admin = AdminApi(self)
        self.loops = ControlLoops(self)
        self.liveness = Liveness(self)
        self.limits = ModelLimits()
        """Vocabulary and context of the model served (first instance that tells); requests are checked on it."""
        self.limits_from: set[str] = set()
        self.front: FrontServer | None = None
        self.shutting_down = False
        self.background: set[asyncio.Task[Any]] = set()
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.session is not None:
            return
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        self._tasks = self.loops.start()
        self._tasks.append(asyncio.create_task(self.proxy.watchdog.run()))
        if self.cfg.liveness_interval_s > 0:
            self._tasks.append(asyncio.create_task(self.liveness.run()))

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Start the background loops and the HTTP server; returns the port."""
        await self.start()
        cfg = self.cfg
        self.front = FrontServer(self.dispatch, cfg.max_body_bytes, cfg.header_timeout_s, cfg.body_timeout_s,
                                 cfg.idle_timeout_s, cfg.max_client_connections,
                                 count=lambda reason: self.metrics.client_events.labels(reason).inc())
        return await self.front.start(host, port)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Graceful: refuse new requests, let those in flight finish (up to timeout_s), stop."""
        self.shutting_down = True
        if self.front is not None:
            await self.front.shutdown(timeout_s)
        await self.stop()

    async def stop(self) -> None:
        self.shutting_down = True
        await self.loops.stop(self._tasks)
        self._tasks = []
        if self.background:
            await asyncio.wait(self.background, timeout=5)
        await self.kv_feed.close()
        self.proxy.close()
        if self.session is not None:
            await self.session.close()
            self.session = None

    @contextlib.asynccontextmanager
    async def serving(self, host: str = "127.0.0.1", port: int = 0,
                      shutdown_timeout_s: float = 2.0) -> AsyncIterator[str]:
        """`async with router.serving() as url:` for tests and embedding."""
        port = await self.serve(host, port)
        try:
            yield f"http://{host}:{port}"
        finally:
            await self.shutdown(shutdown_timeout_s)

    async def dispatch(self, ex: Exchange) -> None:
        endpoint = ENDPOINTS.get(ex.head.path)
        if endpoint is not None and ex.head.method == "POST":
            await self.proxy.handle(ex, endpoint)
        else:
            await self.admin.handle(ex)

    # ------------------------------------------------------------------ membership
    def _on_registry_event(self, event: str, inst: Instance) -> None:
        if event == "remove":
            self.tree.forget(inst.url)
            self.kv_feed.unsubscribe(inst.url)
            self.proxy.forget(inst.url)
            self.metrics.in_flight.labels(inst.url).set(0)
        elif event == "join" and inst.kv_events:
            self.kv_feed.subscribe(inst)
        elif event == "health" and inst.health is Health.DRAINING:
            self.loops.drain_started()

    async def add_instance(self, url: str, role: Role | None = None, bootstrap_port: int | None = None,
                           managed: bool = False) -> Instance:
        """Probe the instance for its role and capacity; if it does not answer yet, add it as STARTING."""
        url = url.rstrip("/")
        await self.start()
        assert self.session is not None
        info: dict[str, Any] = {}
        try:
            info = await probe(self.session, url)
        except ConnectionError:
            if role is None:
                raise
        if role is not None and info and info["role"] is not role and info["role"] is not Role.PLAIN:
            if not info.get("role_switch"):
                raise ValueError(f"{url} reports role {info['role'].value}, not {role.value}")
            # /server_info keeps the launch role after a /pd_role_switch: trust the caller
            log.warning("instance %s reports role %s, taken as %s (role switching is on)", url,
                        info["role"].value, role.value)
        assert role is not None or info
        role = role or info["role"]
        inst = Instance(url=url, role=role, capacity_tokens=info.get("capacity_tokens", 0),
                        bootstrap_port=bootstrap_port or (info.get("bootstrap_port") if role is Role.PREFILL else None),
                        managed=managed,
                        kv_events=info.get("kv_events"), tokenizer_path=info.get("tokenizer_path"))
        if info:
            inst.health = Health.HEALTHY
        self.registry.add(inst)
        if info:
            await self.learn_limits(url)
        return inst

    async def learn_limits(self, url: str) -> None:
        """Vocabulary size and context length from one instance (kept when already known)."""
        if self.session is None or url in self.limits_from:
            return
        self.limits_from.add(url)
        got = await fetch_limits(self.session, url)
        if got.known and not self.limits.known:
            self.limits = got
            log.info("model limits from %s: vocab_size=%s context_len=%s", url, got.vocab_size, got.context_len)

    # ------------------------------------------------------------------ routing state
    def pool_load(self, role: Role) -> PoolLoad:
        members = [i for i in self.registry.pool(role) if i.health in (Health.HEALTHY, Health.STARTING)]
        typical = int(self.typical_prompt.value)
        if role is Role.PREFILL:
            return prefill_pool_load(members, self.ttft_actual[role], self.cfg.ttft_target_s, typical)
        if role is Role.DECODE:
            return decode_pool_load(members, self.tpot_actual[role], self.cfg.tpot_target_s)
        p = prefill_pool_load(members, self.ttft_actual[role], self.cfg.ttft_target_s, typical)
        d = decode_pool_load(members, self.tpot_actual[role], self.cfg.tpot_target_s)
        return p if p.load >= d.load else d

    def pd_mode(self) -> bool:
        return bool(self.registry.pool(Role.PREFILL, routable_only=True)
                    and self.registry.pool(Role.DECODE, routable_only=True))

    def choose_prefill(self, role: Role, shape: RequestShape, prompt_tokens: int, exclude: frozenset[str]) -> Instance:
        """Prefill (or plain) instance: KV-event matches where instances publish, the prefix tree otherwise."""
        cands = self.registry.pool(role)
        known = None
        if self.kv_index.active and self.cfg.policy == "slo_affinity":
            ids = self.kv_feed.token_ids(shape)
            if ids is not None:
                known = self.kv_index.match(ids, [c.url for c in cands])
                self.metrics.kv_lookups.inc()
        return self.picker.pick_prefill(cands, shape.prompt, prompt_tokens, exclude, known=known).instance

    def routed(self, prompt: Prompt, inst: Instance) -> None:
        self.picker.routed(prompt, inst)

    def observe_usage(self, shape: RequestShape, payload: Any) -> tuple[int | None, int | None]:
        """Learn from what the instance reports: token counts, cache hits. Returns (prompt, completion)."""
        if not isinstance(payload, dict):
            return None, None
        meta = payload.get("meta_info") or {}
        usage = payload.get("usage") or {}
        prompt = meta.get("prompt_tokens") or usage.get("prompt_tokens")
        completion = meta.get("completion_tokens") or usage.get("completion_tokens")
        cached = meta.get("cached_tokens")
        if cached is None:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if isinstance(prompt, int) and prompt > 0:
            self.metrics.prompt_tokens.inc(prompt)
            if isinstance(shape.prompt, str):
                self.tokens.observe(shape.prompt_chars, prompt)
            if isinstance(cached, int) and cached > 0:
                self.metrics.cached_tokens.inc(cached)
        return prompt if isinstance(prompt, int) else None, completion if isinstance(completion, int) else None

    def update_gauges(self) -> None:
        for role in Role:
            load = self.pool_load(role)
            self.metrics.slo_load.labels(role.value).set(load.load if load.instances else 0.0)
            self.metrics.slo_pred.labels(role.value).set(load.pred)
            for h in Health:
                self.metrics.instances.labels(role.value, h.value).set(
                    sum(1 for i in self.registry.pool(role, include_draining=True) if i.health is h))
        for inst in self.registry:
            self.metrics.in_flight.labels(inst.url).set(inst.in_flight)
