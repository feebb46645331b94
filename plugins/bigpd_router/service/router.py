"""Layer: service (no SGLang import). The router: request path, admin API and background loops.

Plain mode forwards each request to one instance. PD mode picks a prefill and a decode
instance per request, sends both the same request with SGLang's bootstrap fields (host and
bootstrap port of the prefill instance, a fresh room), and streams the decode side's answer
back. An attempt that fails before anything reached the client is retried on other
instances; a failure after that ends the stream with an explicit error event.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.pairing import NoInstance, Picker
from kllm_plugins.plugins.bigpd_router.core.prefix_tree import PrefixTree
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Instance, Registry, Role
from kllm_plugins.plugins.bigpd_router.core.request_shape import BadRequest, RequestShape, parse
from kllm_plugins.plugins.bigpd_router.core.scaling import Actuator, ScalePolicy, ScalingController
from kllm_plugins.plugins.bigpd_router.core.slo_load import (
    PoolLoad,
    RateEstimator,
    TokenEstimator,
    WindowStat,
    backlog_tokens,
    decode_pool_load,
    prefill_pool_load,
)
from kllm_plugins.plugins.bigpd_router.service.router_metrics import RouterMetrics
from kllm_plugins.plugins.bigpd_router.service.upstream import PATHS, BeforeFirstToken, Ticket, parse_loads, probe

log = logging.getLogger("kllm.bigpd_router.router")
NET_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def error_response(status: int, message: str, rid: str, kind: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}, "request_id": rid}
    return web.json_response(body, status=status, headers={"X-Request-Id": rid})


def sse_error(message: str, status: int) -> bytes:
    return b"data: " + json.dumps({"error": {"message": message, "type": "upstream_error", "code": status}}).encode() \
        + b"\n\ndata: [DONE]\n\n"


class Router:
    def __init__(self, cfg: RouterConfig, actuator: Actuator | None = None,
                 scaled_roles: tuple[Role, ...] = ()) -> None:
        self.cfg = cfg
        self.registry = Registry(cfg.health_failures)
        self.tree = PrefixTree(cfg.affinity_block_chars, cfg.affinity_max_blocks)
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
                                 cfg.max_instances, cfg.drain_timeout_s)
            self.controller = ScalingController(self.registry, actuator, policy, self.pool_load, scaled_roles)
        self.registry.subscribe(self._on_registry_event)
        self.session: aiohttp.ClientSession | None = None
        self.shutting_down = False
        self._tasks: list[asyncio.Task[None]] = []
        self._bg: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        self._tasks.append(asyncio.create_task(self._health_loop()))
        if self.cfg.loads_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._loads_loop()))
        if self.controller is not None and self.cfg.scale_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._scale_loop()))
        else:
            self._tasks.append(asyncio.create_task(self._drain_loop()))

    async def stop(self) -> None:
        self.shutting_down = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._bg:
            await asyncio.wait(self._bg, timeout=5)
        if self.session is not None:
            await self.session.close()
            self.session = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes)
        app.router.add_post("/generate", self._endpoint("generate"))
        app.router.add_post("/v1/completions", self._endpoint("completions"))
        app.router.add_post("/v1/chat/completions", self._endpoint("chat"))
        for path in ("/v1/models", "/model_info", "/get_model_info"):
            app.router.add_get(path, self.passthrough_get)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/admin/instances", self.admin_list)
        app.router.add_post("/admin/instances", self.admin_add)
        app.router.add_delete("/admin/instances", self.admin_remove)
        app.router.add_get("/admin/loads", self.admin_loads)

        async def on_startup(_: web.Application) -> None:
            if self.session is None:
                await self.start()

        async def on_shutdown(_: web.Application) -> None:
            self.shutting_down = True

        async def on_cleanup(_: web.Application) -> None:
            await self.stop()

        app.on_startup.append(on_startup)
        app.on_shutdown.append(on_shutdown)
        app.on_cleanup.append(on_cleanup)
        return app

    # ------------------------------------------------------------------ membership
    def _on_registry_event(self, event: str, inst: Instance) -> None:
        if event == "remove":
            self.tree.forget(inst.url)
            self.metrics.in_flight.labels(inst.url).set(0)

    async def add_instance(self, url: str, role: Role | None = None, bootstrap_port: int | None = None,
                           managed: bool = False) -> Instance:
        """Probe the instance for its role and capacity; if it does not answer yet, add it as STARTING."""
        url = url.rstrip("/")
        assert self.session is not None
        info: dict[str, Any] = {}
        try:
            info = await probe(self.session, url)
        except ConnectionError:
            if role is None:
                raise
        if role is not None and info and info["role"] is not role and info["role"] is not Role.PLAIN:
            raise ValueError(f"{url} reports role {info['role'].value}, not {role.value}")
        assert role is not None or info
        inst = Instance(url=url, role=role or info["role"], capacity_tokens=info.get("capacity_tokens", 0),
                        bootstrap_port=bootstrap_port or info.get("bootstrap_port"), managed=managed)
        if info:
            inst.health = Health.HEALTHY
        return self.registry.add(inst)

    # ------------------------------------------------------------------ SLO load
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

    # ------------------------------------------------------------------ request path
    def _endpoint(self, endpoint: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self.handle(request, endpoint)
        return handler

    async def handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        t0 = time.monotonic()
        if self.shutting_down:
            return self._count(endpoint, error_response(503, "router is shutting down", rid, "unavailable"))
        if request.content_length is not None and request.content_length > self.cfg.max_body_bytes:
            return self._count(endpoint, error_response(413, f"body larger than {self.cfg.max_body_bytes} bytes", rid))
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._count(endpoint, error_response(413, f"body larger than {self.cfg.max_body_bytes} bytes", rid))
        try:
            shape = parse(endpoint, raw)
        except BadRequest as exc:
            return self._count(endpoint, error_response(400, str(exc), rid))
        resp = await self._route(request, shape, raw, rid)
        self.metrics.e2e.observe(time.monotonic() - t0)
        return self._count(endpoint, resp)

    def _count(self, endpoint: str, resp: web.StreamResponse) -> web.StreamResponse:
        self.metrics.requests.labels(endpoint, str(resp.status)).inc()
        return resp

    def _prompt_tokens(self, shape: RequestShape) -> int:
        if not isinstance(shape.prompt, str):
            return len(shape.prompt)
        return self.tokens.estimate(shape.prompt_chars)

    async def _route(self, request: web.Request, shape: RequestShape, raw: bytes, rid: str) -> web.StreamResponse:
        excluded: set[str] = set()
        last: BeforeFirstToken | None = None
        ptoks = self._prompt_tokens(shape)
        self.typical_prompt.update(ptoks)
        for attempt in range(self.cfg.max_retries + 1):
            try:
                if self.pd_mode():
                    p = self.picker.pick_prefill(self.registry.pool(Role.PREFILL), shape.prompt, ptoks,
                                                 frozenset(excluded)).instance
                    d = self.picker.pick_decode(self.registry.pool(Role.DECODE), p, frozenset(excluded))
                    return await self._attempt(request, shape, raw, rid, ptoks, d, p, attempt)
                inst = self.picker.pick_prefill(self.registry.pool(Role.PLAIN), shape.prompt, ptoks,
                                                frozenset(excluded)).instance
                return await self._attempt(request, shape, raw, rid, ptoks, inst, None, attempt)
            except NoInstance as exc:
                if last is None:
                    return error_response(503, f"no instance available: {exc}", rid, "unavailable")
                break
            except BeforeFirstToken as exc:
                last = exc
                excluded |= exc.urls
                for url in exc.urls:
                    self.registry.mark_check(url, False)
                if attempt < self.cfg.max_retries:
                    self.metrics.retries.labels("timeout" if exc.status == 504 else "error").inc()
                    log.warning("retrying rid=%s failed=%s reason=%s", rid, sorted(exc.urls), exc.reason)
        assert last is not None
        return error_response(last.status, f"all attempts failed before the first token: {last.reason}", rid,
                              "upstream_error")

    async def _attempt(self, request: web.Request, shape: RequestShape, raw: bytes, rid: str, ptoks: int,
                       inst: Instance, prefill: Instance | None, attempt: int) -> web.StreamResponse:
        assert self.session is not None
        cfg = self.cfg
        headers = {"Content-Type": "application/json", "X-Request-Id": rid}
        url = inst.url + PATHS[shape.endpoint]
        prefill_task: asyncio.Task[None] | None = None
        pticket: Ticket | None = None
        pool = Role.DECODE if prefill is not None else Role.PLAIN
        if prefill is not None:
            host = urlsplit(prefill.url).hostname
            body = dict(shape.body, bootstrap_host=host, bootstrap_port=prefill.bootstrap_port,
                        bootstrap_room=random.getrandbits(63))
            raw = json.dumps(body).encode()
            pbody = dict(body, stream=False)
            pbody.pop("stream_options", None)
            pticket = Ticket(prefill, ptoks, backlog_tokens(prefill))
            prefill_task = asyncio.create_task(self._prefill_side(prefill, shape, pbody, headers, pticket))
            self._bg.add(prefill_task)
            prefill_task.add_done_callback(self._prefill_finished)
            ticket = Ticket(inst, 0, 0)
        else:
            ticket = Ticket(inst, ptoks, backlog_tokens(inst))
        self.picker.routed(shape.prompt, prefill or inst)
        self.metrics.in_flight.labels(inst.url).set(inst.in_flight)
        upstream: aiohttp.ClientResponse | None = None
        try:
            try:
                upstream = await self._first(self.session.post(url, data=raw, headers=headers), prefill_task,
                                             cfg.first_token_timeout_s)
                if upstream.status >= 500:
                    text = (await upstream.read())[:300].decode(errors="replace")
                    raise BeforeFirstToken({inst.url}, f"{inst.url} answered {upstream.status}: {text}")
                if not shape.stream or upstream.status != 200:
                    data = await self._first(upstream.read(), prefill_task, cfg.request_timeout_s)
                    return self._complete(upstream, data, shape, ticket, pticket, rid, attempt, prefill)
                first = await self._first(upstream.content.readany(), prefill_task, cfg.first_token_timeout_s)
                if not first:
                    raise BeforeFirstToken({inst.url}, f"{inst.url} closed the stream before the first token")
            except asyncio.TimeoutError:
                blame = {inst.url} | ({prefill.url} if prefill is not None else set())
                raise BeforeFirstToken(blame, "no first token in time", 504) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise BeforeFirstToken({inst.url}, f"{inst.url}: {exc!r}") from None
            return await self._stream(request, upstream, first, shape, ticket, pticket, rid, attempt, prefill)
        except BeforeFirstToken:
            if prefill_task is not None:
                prefill_task.cancel()
            raise
        finally:
            if upstream is not None:
                upstream.release()
            ticket.finish()
            if pticket is not None and prefill_task is not None and prefill_task.done():
                pticket.finish()
            self.metrics.in_flight.labels(inst.url).set(inst.in_flight)

    async def _first(self, aw: Awaitable[Any], prefill_task: asyncio.Task[None] | None, timeout: float) -> Any:
        """Await `aw`, but fail early (blaming the prefill instance) if the PD prefill side fails first."""
        if prefill_task is None:
            return await asyncio.wait_for(aw, timeout)
        main = asyncio.ensure_future(aw)
        done, _ = await asyncio.wait({main, prefill_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if main in done:
            return main.result()
        if prefill_task in done and prefill_task.exception() is not None:
            main.cancel()
            raise prefill_task.exception()  # type: ignore[misc]
        if prefill_task in done:  # prefill finished fine; keep waiting for the decode side
            return await asyncio.wait_for(main, timeout)
        main.cancel()
        raise asyncio.TimeoutError

    def _prefill_finished(self, task: asyncio.Task[None]) -> None:
        self._bg.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("prefill side failed: %s", task.exception())

    async def _prefill_side(self, prefill: Instance, shape: RequestShape, body: dict[str, Any],
                            headers: dict[str, str], ticket: Ticket) -> None:
        assert self.session is not None
        try:
            async with self.session.post(prefill.url + PATHS[shape.endpoint], json=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)) as r:
                data = await r.read()
                if r.status >= 500:
                    raise BeforeFirstToken({prefill.url}, f"prefill {prefill.url} answered {r.status}: "
                                           f"{data[:200].decode(errors='replace')}")
            ticket.prefill_done()
        except NET_ERRORS as exc:
            ticket.finish()
            raise BeforeFirstToken({prefill.url}, f"prefill {prefill.url}: {exc!r}") from None
        except BaseException:
            ticket.finish()
            raise

    def _observe_usage(self, shape: RequestShape, payload: Any) -> tuple[int | None, int | None]:
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

    def _complete(self, upstream: aiohttp.ClientResponse, data: bytes, shape: RequestShape, ticket: Ticket,
                  pticket: Ticket | None, rid: str, attempt: int, prefill: Instance | None) -> web.Response:
        now = time.monotonic()
        completion = None
        if upstream.status == 200:
            try:
                _, completion = self._observe_usage(shape, json.loads(data))
            except json.JSONDecodeError:
                pass
            # the TTFT of a non-streamed answer is not visible: infer it from the decode rate
            n = completion or 1
            ttft = ticket.first_token(at=now - (n - 1) * ticket.inst.tpot.value)
            ticket.t_last, ticket.events = now, 0
            ticket.finish(tokens=n)
            self.ttft_actual[Role.PREFILL if prefill else Role.PLAIN].add(ttft)
            self.metrics.ttft.observe(ttft)
        self._log(rid, shape, upstream.status, ticket, prefill, attempt)
        return web.Response(body=data, status=upstream.status,
                            headers={"X-Request-Id": rid, "X-Kllm-Instance": ticket.inst.url},
                            content_type=upstream.content_type or "application/json")

    async def _stream(self, request: web.Request, upstream: aiohttp.ClientResponse, first: bytes,
                      shape: RequestShape, ticket: Ticket, pticket: Ticket | None, rid: str, attempt: int,
                      prefill: Instance | None) -> web.StreamResponse:
        ttft = ticket.first_token()
        if pticket is not None:
            pticket.first_token()
        self.ttft_actual[Role.PREFILL if prefill else Role.PLAIN].add(ttft)
        self.metrics.ttft.observe(ttft)
        out = web.StreamResponse(status=200, headers={
            "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache", "X-Request-Id": rid, "X-Kllm-Instance": ticket.inst.url})
        try:
            await out.prepare(request)
        except ConnectionResetError:  # the client left before the first byte went out
            upstream.close()
            self._log(rid, shape, 499, ticket, prefill, attempt)
            return out
        tail = b""
        status = 200
        chunk = first
        deadline = ticket.t0 + self.cfg.request_timeout_s
        try:
            while chunk:
                ticket.events += chunk.count(b"data:") - chunk.count(b"data: [DONE]")
                ticket.t_last = time.monotonic()
                tail = (tail + chunk)[-16384:]
                await out.write(chunk)
                try:
                    chunk = await asyncio.wait_for(upstream.content.readany(), deadline - time.monotonic())
                except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
                    status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
                    log.warning("stream broke rid=%s instance=%s error=%r", rid, ticket.inst.url, exc)
                    self.registry.mark_check(ticket.inst.url, False)
                    await out.write(sse_error(f"instance failed mid-stream: {exc!r}", status))
                    break
            else:
                if not tail.rstrip().endswith(b"[DONE]") and shape.endpoint != "generate":
                    status = 502
                    await out.write(sse_error("instance closed the stream early", status))
            await out.write_eof()
        except ConnectionResetError:
            status = 499  # the client went away; closing upstream aborts the request in SGLang
            log.info("client disconnected rid=%s", rid)
            upstream.close()
        except asyncio.CancelledError:
            upstream.close()
            raise
        self._observe_usage(shape, _last_event(tail))
        tp = ticket.tpot()
        if tp is not None:
            self.tpot_actual[Role.DECODE if prefill else Role.PLAIN].add(tp)
            self.metrics.tpot.observe(tp)
        self._log(rid, shape, status, ticket, prefill, attempt)
        return out

    def _log(self, rid: str, shape: RequestShape, status: int, ticket: Ticket, prefill: Instance | None,
             attempt: int) -> None:
        ttft = (ticket.t_first - ticket.t0) if ticket.t_first is not None else None
        fields = {"rid": rid, "endpoint": shape.endpoint, "status": status, "instance": ticket.inst.url,
                  "prefill": prefill.url if prefill else None, "stream": shape.stream, "retries": attempt,
                  "ttft_ms": round(ttft * 1000, 2) if ttft is not None else None,
                  "total_ms": round((time.monotonic() - ticket.t0) * 1000, 2)}
        log.info("request rid=%s endpoint=%s status=%d instance=%s retries=%d", rid, shape.endpoint, status,
                 ticket.inst.url, attempt, extra={"kllm": fields})

    # ------------------------------------------------------------------ other endpoints
    async def passthrough_get(self, request: web.Request) -> web.Response:
        assert self.session is not None
        cands = [i for i in self.registry if i.routable and i.role is not Role.PREFILL]
        if not cands:
            return error_response(503, "no instance available", uuid.uuid4().hex, "unavailable")
        try:
            async with self.session.get(cands[0].url + request.path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)
        except NET_ERRORS as exc:
            return error_response(502, f"{cands[0].url}: {exc!r}", uuid.uuid4().hex, "upstream_error")

    async def health(self, request: web.Request) -> web.Response:
        ok = not self.shutting_down and (self.pd_mode() or bool(self.registry.pool(Role.PLAIN, routable_only=True)))
        return web.json_response({"status": "ok" if ok else "unavailable",
                                  "mode": "pd" if self.pd_mode() else "plain"}, status=200 if ok else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        self._update_gauges()
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _update_gauges(self) -> None:
        for role in Role:
            load = self.pool_load(role)
            self.metrics.slo_load.labels(role.value).set(load.load if load.instances else 0.0)
            self.metrics.slo_pred.labels(role.value).set(load.pred)
            for h in Health:
                self.metrics.instances.labels(role.value, h.value).set(
                    sum(1 for i in self.registry.pool(role, include_draining=True) if i.health is h))

    async def admin_list(self, request: web.Request) -> web.Response:
        return web.json_response({"instances": [i.snapshot() for i in self.registry]})

    async def admin_loads(self, request: web.Request) -> web.Response:
        out = {}
        for role in Role:
            load = self.pool_load(role)
            out[role.value] = {"load": load.load, "pred": load.pred, "actual": load.actual,
                               "target": load.target, "instances": load.instances}
        decisions = [d.__dict__ | {"role": d.role.value} for d in (self.controller.decisions if self.controller else [])]
        return web.json_response({"pools": out, "mode": "pd" if self.pd_mode() else "plain",
                                  "scale_decisions": decisions[-50:]})

    async def admin_add(self, request: web.Request) -> web.Response:
        rid = uuid.uuid4().hex
        try:
            body = await request.json()
            url = body["url"]
            role = Role(body["role"]) if body.get("role") else None
            bport = body.get("bootstrap_port")
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError("'url' must be an http(s) URL")
        except (json.JSONDecodeError, KeyError, ValueError, TypeError) as exc:
            return error_response(400, f"expected {{'url': ..., 'role'?: plain|prefill|decode}}: {exc}", rid)
        if url.rstrip("/") in self.registry:
            return error_response(409, f"{url} is already registered", rid)
        try:
            inst = await self.add_instance(url, role, bport)
        except ConnectionError as exc:
            return error_response(502, f"{exc}; give 'role' to add it before it is up", rid, "upstream_error")
        except ValueError as exc:
            return error_response(409, str(exc), rid)
        return web.json_response(inst.snapshot(), status=201)

    async def admin_remove(self, request: web.Request) -> web.Response:
        url = request.query.get("url")
        if url is None:
            try:
                url = (await request.json()).get("url")
            except (json.JSONDecodeError, AttributeError):
                url = None
        if not url:
            return error_response(400, "give the instance as ?url=... or {'url': ...}", uuid.uuid4().hex)
        url = url.rstrip("/")
        if url not in self.registry:
            return error_response(404, f"{url} is not registered", uuid.uuid4().hex)
        inst = self.registry.start_drain(url)
        return web.json_response(inst.snapshot(), status=202)

    # ------------------------------------------------------------------ background loops
    async def _health_loop(self) -> None:
        assert self.session is not None
        # generous on purpose: a busy instance answers /health late, and a false "down" costs more
        timeout = aiohttp.ClientTimeout(total=max(5.0, self.cfg.health_interval_s))

        async def check(inst: Instance) -> None:
            assert self.session is not None
            try:
                async with self.session.get(inst.url + "/health", timeout=timeout) as r:
                    ok = r.status == 200
            except NET_ERRORS:
                ok = False
            if ok and (inst.health is Health.STARTING or (inst.role is Role.PREFILL and inst.bootstrap_port is None)):
                try:
                    info = await probe(self.session, inst.url)
                    inst.capacity_tokens = info["capacity_tokens"] or inst.capacity_tokens
                    inst.bootstrap_port = inst.bootstrap_port or info["bootstrap_port"]
                except ConnectionError:
                    ok = False
            self.registry.mark_check(inst.url, ok)

        while True:
            await asyncio.gather(*(check(i) for i in self.registry), return_exceptions=True)
            self._update_gauges()
            await asyncio.sleep(self.cfg.health_interval_s)

    async def _loads_loop(self) -> None:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.cfg.loads_interval_s * 2))

        async def poll(inst: Instance) -> None:
            assert self.session is not None
            try:
                async with self.session.get(inst.url + "/v1/loads?include=core,memory", timeout=timeout) as r:
                    if r.status != 200:
                        return
                    loads = parse_loads(await r.json(content_type=None))
            except (*NET_ERRORS, json.JSONDecodeError):
                return
            rep = inst.reported
            rep.running_reqs, rep.waiting_reqs = int(loads["running"]), int(loads["waiting"])
            rep.waiting_tokens = int(loads["waiting_tokens"])
            rep.token_usage = loads["used"] / loads["total"] if loads["total"] else 0.0
            rep.gen_throughput, rep.at = loads["gen"], time.monotonic()
            if loads["total"] and not inst.capacity_tokens:
                inst.capacity_tokens = int(loads["total"])

        while True:
            await asyncio.gather(*(poll(i) for i in self.registry if i.routable), return_exceptions=True)
            await asyncio.sleep(self.cfg.loads_interval_s)

    async def _drain_loop(self) -> None:
        """Without a controller: remove drained instances once their in-flight requests are done."""
        while True:
            now = time.monotonic()
            for inst in list(self.registry):
                if inst.health is Health.DRAINING and inst.drain_started is not None and (
                        inst.in_flight == 0 or now - inst.drain_started >= self.cfg.drain_timeout_s):
                    self.registry.remove(inst.url)
                    if inst.managed and self.actuator is not None:
                        await asyncio.to_thread(self.actuator.remove, inst.url, inst.role)
            await asyncio.sleep(0.2)

    async def _scale_loop(self) -> None:
        assert self.controller is not None
        discover = getattr(self.actuator, "discover", None)
        while True:
            try:
                if callable(discover):  # e.g. Kubernetes: pods join once they are Ready
                    for role in self.controller.deciders:
                        for url in await asyncio.to_thread(discover, role):
                            if url not in self.registry:
                                inst = await self.add_instance(url, role, managed=True)
                                log.info("discovered instance url=%s role=%s", inst.url, role.value)
                decisions = await asyncio.to_thread(self.controller.step)
                for d in decisions:
                    if d.action != "hold":
                        self.metrics.scale_actions.labels(d.role.value, d.action).inc()
            except Exception:  # a failing actuator must not kill the router
                log.exception("scaling step failed")
            await asyncio.sleep(self.cfg.scale_interval_s)


def _last_event(tail: bytes) -> Any:
    """The last JSON `data:` event of an SSE stream (it carries usage / meta_info)."""
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if line.startswith(b"data:") and not line.endswith(b"[DONE]"):
            try:
                return json.loads(line[5:])
            except json.JSONDecodeError:
                return None
    return None
