"""Layer: service (no SGLang import). Endpoints other than generation: health, metrics, models, admin.

`GET /health` (503 while no instance can serve or while shutting down), `GET /health_generate`
(SGLang's generate probe, 200 when each serving role has an instance whose own probe passes), `GET /metrics`
(Prometheus), `GET /v1/models` and model info passed through to an instance, `/server_info`
(an instance's, or in PD mode `{"prefill": [...], "decode": [...]}` as SGLang's own router answers),
`/flush_cache` sent to every instance, and the admin API:
`GET/POST/DELETE /admin/instances` (DELETE drains first) and `GET /admin/loads`.
"""
from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Awaitable, Callable
from urllib.parse import parse_qs

import aiohttp

from kllm_plugins.plugins.bigpd_router.core.registry import Role
from kllm_plugins.plugins.bigpd_router.core.request_shape import loads
from kllm_plugins.plugins.bigpd_router.service.front_server import Exchange
from kllm_plugins.plugins.bigpd_router.service.proxy import error_body

if TYPE_CHECKING:
    from kllm_plugins.plugins.bigpd_router.service.router import Router

NET_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class AdminApi:
    def __init__(self, router: Router) -> None:
        self.r = router
        self.routes: dict[tuple[str, str], Callable[[Exchange], Awaitable[None]]] = {
            ("GET", "/health"): self.health,
            ("GET", "/health_generate"): self.health_generate,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/admin/instances"): self.list_instances,
            ("POST", "/admin/instances"): self.add_instance,
            ("DELETE", "/admin/instances"): self.remove_instance,
            ("GET", "/admin/loads"): self.loads,
        }
        for path in ("/v1/models", "/model_info", "/get_model_info"):
            self.routes[("GET", path)] = self.passthrough_get
        for path in ("/server_info", "/get_server_info"):
            self.routes[("GET", path)] = self.server_info
        for method in ("GET", "POST"):
            self.routes[(method, "/flush_cache")] = self.flush_cache

    def _error(self, ex: Exchange, status: int, message: str, kind: str = "invalid_request_error") -> None:
        ex.reply(status, error_body(status, message, "", kind))

    async def handle(self, ex: Exchange) -> None:
        fn = self.routes.get((ex.head.method, ex.head.path))
        if fn is not None:
            return await fn(ex)
        if any(path == ex.head.path for _, path in self.routes) or ex.head.path in (
                "/generate", "/v1/completions", "/v1/chat/completions"):
            return self._error(ex, 405, f"method {ex.head.method} not allowed on {ex.head.path}")
        self._error(ex, 404, f"no route {ex.head.path}")

    async def passthrough_get(self, ex: Exchange) -> None:
        session = self.r.session
        assert session is not None
        cands = [i for i in self.r.registry if i.routable and i.role is not Role.PREFILL]
        if not cands:
            return self._error(ex, 503, "no instance available", "unavailable")
        try:
            path = ex.head.path + ("?" + ex.head.query if ex.head.query else "")
            async with session.get(cands[0].url + path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                ex.reply(r.status, await r.read(), r.content_type)
        except NET_ERRORS as exc:
            self._error(ex, 502, f"{cands[0].url}: {exc!r}", "upstream_error")

    async def server_info(self, ex: Exchange) -> None:
        session = self.r.session
        assert session is not None
        cands = [i for i in self.r.registry if i.routable]
        if not cands:
            return self._error(ex, 503, "no instance available", "unavailable")

        async def one(url: str) -> object:
            async with session.get(url + "/server_info", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return await r.json(content_type=None) if r.status == 200 else None

        if not self.r.pd_mode():
            inst = next((i for i in cands if i.role is Role.PLAIN), cands[0])
            try:
                info = await one(inst.url)
            except (*NET_ERRORS, ValueError) as exc:
                return self._error(ex, 502, f"{inst.url}: {exc!r}", "upstream_error")
            return ex.reply_json(200, info) if info is not None else self._error(
                ex, 502, f"{inst.url} did not answer /server_info", "upstream_error")
        out: dict[str, list[object]] = {"prefill": [], "decode": []}
        pd = [i for i in cands if i.role in (Role.PREFILL, Role.DECODE)]
        infos = await asyncio.gather(*(one(i.url) for i in pd), return_exceptions=True)
        for inst, info in zip(pd, infos):
            if isinstance(info, dict):
                out[inst.role.value].append(info)
        ex.reply_json(200, out)

    async def flush_cache(self, ex: Exchange) -> None:
        """Every instance's prefix cache (SGLang /flush_cache, its query passed on); 200 only if all flushed."""
        session = self.r.session
        assert session is not None
        insts = [i for i in self.r.registry if i.routable]
        if not insts:
            return self._error(ex, 503, "no instance available", "unavailable")
        path = "/flush_cache" + ("?" + ex.head.query if ex.head.query else "")

        async def one(url: str) -> tuple[int, str]:
            async with session.post(url + path, timeout=aiohttp.ClientTimeout(total=60)) as r:
                return r.status, (await r.read())[:200].decode(errors="replace")

        results = await asyncio.gather(*(one(i.url) for i in insts), return_exceptions=True)
        failed = {i.url: (repr(res) if isinstance(res, BaseException) else res[1])
                  for i, res in zip(insts, results) if isinstance(res, BaseException) or res[0] != 200}
        if failed:
            return self._error(ex, 502, f"flush failed on {len(failed)} of {len(insts)} instances: {failed}",
                               "upstream_error")
        ex.reply(200, f"Cache flushed on {len(insts)} instances.\n".encode(), "text/plain")

    async def health(self, ex: Exchange) -> None:
        r = self.r
        pd = r.pd_mode()
        ok = not r.shutting_down and (pd or bool(r.registry.pool(Role.PLAIN, routable_only=True)))
        ex.reply_json(200 if ok else 503, {"status": "ok" if ok else "unavailable", "mode": "pd" if pd else "plain"})

    async def health_generate(self, ex: Exchange) -> None:
        """SGLang's `/health_generate` (a real generation) asked of the instances: 200 when every role
        the router serves with (plain, or prefill and decode) has a routable instance that passes it."""
        r = self.r
        session = r.session
        assert session is not None
        roles = (Role.PREFILL, Role.DECODE) if r.pd_mode() else (Role.PLAIN,)
        timeout = aiohttp.ClientTimeout(total=max(20.0, r.cfg.health_interval_s))

        async def passes(url: str) -> bool:
            try:
                async with session.get(url + "/health_generate", timeout=timeout) as resp:
                    return resp.status == 200
            except NET_ERRORS:
                return False

        failing = [role.value for role in roles] if r.shutting_down else []
        for role in () if r.shutting_down else roles:
            results = await asyncio.gather(*(passes(i.url) for i in r.registry.pool(role, routable_only=True)))
            if not any(results):
                failing.append(role.value)
        if failing:
            return ex.reply_json(503, {"status": "unavailable", "failing_roles": failing})
        ex.reply_json(200, {"status": "ok", "mode": "pd" if r.pd_mode() else "plain"})

    async def metrics(self, ex: Exchange) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        self.r.update_gauges()
        ex.reply(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)

    async def list_instances(self, ex: Exchange) -> None:
        ex.reply_json(200, {"instances": [i.snapshot() for i in self.r.registry]})

    async def loads(self, ex: Exchange) -> None:
        r = self.r
        out = {}
        for role in Role:
            load = r.pool_load(role)
            out[role.value] = {"load": load.load, "pred": load.pred, "actual": load.actual,
                               "target": load.target, "instances": load.instances}
        decisions = [d.__dict__ | {"role": d.role.value} for d in (r.controller.decisions if r.controller else [])]
        ex.reply_json(200, {"pools": out, "mode": "pd" if r.pd_mode() else "plain",
                            "scale_decisions": decisions[-50:], "kv_events": r.kv_index.summary()})

    async def add_instance(self, ex: Exchange) -> None:
        try:
            body = loads(ex.body)
            url = body["url"]
            role = Role(body["role"]) if body.get("role") else None
            bport = body.get("bootstrap_port")
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError("'url' must be an http(s) URL")
        except (KeyError, ValueError, TypeError) as exc:
            return self._error(ex, 400, f"expected {{'url': ..., 'role'?: plain|prefill|decode}}: {exc}")
        if url.rstrip("/") in self.r.registry:
            return self._error(ex, 409, f"{url} is already registered")
        try:
            inst = await self.r.add_instance(url, role, bport)
        except ConnectionError as exc:
            return self._error(ex, 502, f"{exc}; give 'role' to add it before it is up", "upstream_error")
        except ValueError as exc:
            return self._error(ex, 409, str(exc))
        ex.reply_json(201, inst.snapshot())

    async def remove_instance(self, ex: Exchange) -> None:
        url = (parse_qs(ex.head.query).get("url") or [None])[0]
        if url is None and ex.body:
            try:
                url = json.loads(ex.body).get("url")
            except (ValueError, AttributeError):
                url = None
        if not url:
            return self._error(ex, 400, "give the instance as ?url=... or {'url': ...}")
        url = url.rstrip("/")
        if url not in self.r.registry:
            return self._error(ex, 404, f"{url} is not registered")
        inst = self.r.registry.start_drain(url)
        ex.reply_json(202, inst.snapshot())
