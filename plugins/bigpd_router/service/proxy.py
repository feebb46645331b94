"""Layer: service (no SGLang import). The request path: choose instances, forward, relay, retry.

Plain mode forwards the client's body bytes unchanged to one instance over a pooled keep-alive
connection. PD mode picks a prefill and a decode instance per request and sends both the body
with SGLang's bootstrap fields (host and bootstrap port of the prefill, a fresh room); the
decode side's answer is relayed. An attempt that fails before anything reached the client is
retried on other instances; after that a failure ends the stream with an explicit error event.
Per request the body is parsed once (validation and the affinity prompt), nothing is
re-encoded in plain mode, and no task is created outside PD mode.

Hostile conditions: token ids outside the vocabulary (or prompts over the context) are refused
before they reach an instance; a request whose instance dropped the connection under it is
retried at most once and, if it drops a second instance, quarantined (`core.poison`). Deadlines,
stalls, instances marked down and clients that leave are seen by the `watchdog`, which cancels
the handler with a reason turned here into a retry (nothing sent yet), an error event (stream
started) or a 499 (client gone; the upstream connection is closed, which aborts the request).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import time
from typing import TYPE_CHECKING, Any, Awaitable
from urllib.parse import urlsplit

from kllm_plugins.plugins.bigpd_router.core.input_limits import token_id_problem
from kllm_plugins.plugins.bigpd_router.core.pairing import NoInstance
from kllm_plugins.plugins.bigpd_router.core.poison import PoisonLedger, fingerprint
from kllm_plugins.plugins.bigpd_router.core.registry import Instance, Role
from kllm_plugins.plugins.bigpd_router.core.request_shape import BadRequest, RequestShape, loads, parse
from kllm_plugins.plugins.bigpd_router.core.slo_load import backlog_tokens, measured_tpot
from kllm_plugins.plugins.bigpd_router.service.front_server import Exchange, dumps
from kllm_plugins.plugins.bigpd_router.service.http_wire import BadHttp, ChunkedDecoder, chunk
from kllm_plugins.plugins.bigpd_router.service.upstream import PATHS, BeforeFirstToken, Ticket
from kllm_plugins.plugins.bigpd_router.service.upstream_pool import SinkError, UpstreamPool, UpstreamResponse
from kllm_plugins.plugins.bigpd_router.service.watchdog import Watch, Watchdog

if TYPE_CHECKING:
    from kllm_plugins.plugins.bigpd_router.service.router import Router

log = logging.getLogger("kllm.bigpd_router.router")
ENDPOINTS = {"/generate": "generate", "/v1/completions": "completions", "/v1/chat/completions": "chat"}
UPSTREAM_ERRORS = (ConnectionError, OSError, BadHttp)


class ClientGone(Exception):
    """The client closed or reset its connection while its request was in flight."""


def _taken_back(watch: Watch) -> str | None:
    """Inside `except CancelledError`: the watchdog's reason (the cancellation is withdrawn), or None
    when the cancellation came from elsewhere (then the caller re-raises it)."""
    reason = watch.reason
    if reason is not None:
        watch.task.uncancel()
        watch.reason = None
    return reason


def error_body(status: int, message: str, rid: str, kind: str = "invalid_request_error") -> bytes:
    return dumps({"error": {"message": message, "type": kind, "code": status}, "request_id": rid})


def sse_error(message: str, status: int) -> bytes:
    return b"data: " + dumps({"error": {"message": message, "type": "upstream_error", "code": status}}) \
        + b"\n\ndata: [DONE]\n\n"


class Address:
    __slots__ = ("host", "port", "tls", "host_header")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.tls else 80)
        self.host_header = parts.netloc.encode("latin-1")


class Proxy:
    def __init__(self, router: Router) -> None:
        self.r = router
        self.pool = UpstreamPool()
        self.probes = UpstreamPool(max_idle_per_host=4)
        """Keep-alive connections of the background loops' probes (`get`), apart from the requests'."""
        self._addr: dict[str, Address] = {}
        self._rid_prefix = os.urandom(6).hex() + "-"
        self._rid_seq = itertools.count(1)
        self._counted: dict[tuple[str, int], Any] = {}
        # a started stream on an instance marked down ends only once it is silent too, and not at the
        # first second of silence: a loaded event loop (or a false "down") must not cut live streams
        self.watchdog = Watchdog(down_grace_s=max(5.0, 2 * router.cfg.liveness_timeout_s),
                                 on_fire=lambda reason: router.metrics.watchdog.labels(reason).inc())
        self.poison = PoisonLedger(router.cfg.poison_quarantine_s)

    # ------------------------------------------------------------------ helpers
    def address(self, url: str) -> Address:
        a = self._addr.get(url)
        if a is None:
            a = self._addr[url] = Address(url)
        return a

    def forget(self, url: str) -> None:
        self._addr.pop(url, None)

    def _error(self, ex: Exchange, status: int, message: str, rid: str, kind: str = "invalid_request_error") -> None:
        ex.reply(status, error_body(status, message, rid, kind), headers=(("X-Request-Id", rid),))

    def _count(self, endpoint: str, status: int) -> None:
        child = self._counted.get((endpoint, status))
        if child is None:
            child = self._counted[(endpoint, status)] = self.r.metrics.requests.labels(endpoint, str(status))
        child.inc()

    async def _send(self, inst: Instance, path: str, rid: str, body: bytes, auth: str | None) -> UpstreamResponse:
        a = self.address(inst.url)
        extra = b"Authorization: %b\r\n" % auth.encode("latin-1") if auth else b""
        head = (b"POST %b HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\nX-Request-Id: %b\r\n%b"
                b"Content-Length: %d\r\n\r\n" % (path.encode(), a.host_header, rid.encode("latin-1"), extra,
                                                  len(body)))
        return await self.pool.request(a.host, a.port, head, body, tls=a.tls)

    async def get(self, url: str, path: str, timeout_s: float) -> tuple[int, bytes]:
        """A GET of `path` on an instance over pooled keep-alive connections of their own (the probes
        of the background loops: far cheaper than an aiohttp request); raises ConnectionError,
        OSError, BadHttp or TimeoutError."""
        a = self.address(url)
        head = b"GET %b HTTP/1.1\r\nHost: %b\r\n\r\n" % (path.encode(), a.host_header)
        resp: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self.probes.request(a.host, a.port, head, b"", tls=a.tls)
                return resp.status, await resp.read_all()
        finally:
            if resp is not None and not resp.complete:
                resp.close()

    # ------------------------------------------------------------------ entry
    async def handle(self, ex: Exchange, endpoint: str) -> None:
        rid = ex.header("x-request-id") or self._rid_prefix + format(next(self._rid_seq), "x")
        t0 = time.monotonic()
        if self.r.shutting_down:
            self._error(ex, 503, "router is shutting down", rid, "unavailable")
        elif ex.refused is not None:
            self._error(ex, ex.refused[0], ex.refused[1], rid)
        else:
            try:
                shape = parse(endpoint, ex.body)
            except BadRequest as exc:
                self._error(ex, 400, str(exc), rid)
            else:
                problem = self._input_problem(shape)
                if problem is not None:
                    self.r.metrics.refused.labels("input").inc()
                    self._error(ex, 400, problem, rid)
                elif self.poison and self.poison.quarantined(fingerprint(ex.body)):
                    self.r.metrics.refused.labels("poison").inc()
                    self._error(ex, 422, "refused: an identical request crashed two instances (connection dropped "
                                "with no answer); it is not sent again until its quarantine ends", rid,
                                "poison_request")
                else:
                    await self._watched(ex, shape, rid)
                    self.r.metrics.e2e.observe(time.monotonic() - t0)
        self._count(endpoint, ex.status)

    def _input_problem(self, shape: RequestShape) -> str | None:
        lim = self.r.limits
        if not self.r.cfg.validate_inputs or not lim.known or isinstance(shape.prompt, str):
            return None
        return token_id_problem(shape.prompt, lim.vocab_size, lim.context_len)

    async def _watched(self, ex: Exchange, shape: RequestShape, rid: str) -> None:
        task = asyncio.current_task()
        assert task is not None
        watch = Watch(task, ex)
        wd = self.watchdog
        wd.add(watch)
        try:
            await self._route(ex, shape, rid, watch)
        except (ClientGone, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError) and _taken_back(watch) is None:
                raise
            self.client_left(ex, "waiting")
            log.info("request rid=%s endpoint=%s status=499 (client disconnected before the answer; aborted "
                     "upstream)", rid, shape.endpoint, extra={"kllm": {"rid": rid, "endpoint": shape.endpoint,
                                                                      "status": 499, "stream": shape.stream}})
        finally:
            wd.discard(watch)

    def client_left(self, ex: Exchange, phase: str) -> None:
        """The client went away: counted as 499 (and as a disconnect); nothing more is written to it."""
        ex.status, ex.keep_alive = 499, False
        self.r.metrics.disconnects.labels(phase).inc()

    async def _route(self, ex: Exchange, shape: RequestShape, rid: str, watch: Watch) -> None:
        r = self.r
        excluded: set[str] = set()
        last: BeforeFirstToken | None = None
        ptoks = len(shape.prompt) if not isinstance(shape.prompt, str) else r.tokens.estimate(shape.prompt_chars)
        r.typical_prompt.update(ptoks)
        for attempt in range(r.cfg.max_retries + 1):
            try:
                if r.pd_mode():
                    p = r.choose_prefill(Role.PREFILL, shape, ptoks, frozenset(excluded))
                    d = r.picker.pick_decode(r.registry.pool(Role.DECODE), p, frozenset(excluded))
                    return await self._attempt(ex, shape, rid, ptoks, d, p, attempt, watch)
                inst = r.choose_prefill(Role.PLAIN, shape, ptoks, frozenset(excluded))
                return await self._attempt(ex, shape, rid, ptoks, inst, None, attempt, watch)
            except NoInstance as exc:
                if last is None:
                    return self._error(ex, 503, f"no instance available: {exc}", rid, "unavailable")
                break
            except BeforeFirstToken as exc:
                watch.disarm()
                last = exc
                excluded |= exc.urls
                for url in exc.urls:
                    if exc.crashed:
                        r.registry.mark_down(url, "dropped a request with no answer")
                    else:
                        r.registry.mark_check(url, False)
                if exc.crashed:
                    crashes = self.poison.crashed(fingerprint(ex.body), min(exc.urls))
                    if crashes >= 2:
                        r.metrics.refused.labels("poison").inc()
                        log.warning("poison request rid=%s crashed=%d instances; not retried", rid, crashes)
                        return self._error(
                            ex, 502, f"the request was on {crashes} instances that each dropped it with no answer "
                            f"(last: {exc.reason}); it is not retried and identical requests are refused for "
                            f"{r.cfg.poison_quarantine_s:.0f} s", rid, "poison_request")
                if attempt < r.cfg.max_retries:
                    r.metrics.retries.labels("timeout" if exc.status == 504 else "error").inc()
                    log.warning("retrying rid=%s failed=%s reason=%s", rid, sorted(exc.urls), exc.reason)
        assert last is not None
        self._error(ex, last.status, f"all attempts failed before the first token: {last.reason}", rid,
                    "upstream_error")

    # ------------------------------------------------------------------ one attempt
    async def _within(self, aw: Awaitable[Any], prefill_task: asyncio.Task[None] | None, timeout: float) -> Any:
        """Await `aw` within `timeout`; in PD mode fail early (blaming the prefill) if the prefill side fails."""
        if prefill_task is None:  # plain mode: the watchdog keeps the deadlines (no timer per read)
            return await aw
        main = asyncio.ensure_future(aw)
        try:
            done, _ = await asyncio.wait({main, prefill_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            main.cancel()
            raise
        if main in done:
            return main.result()
        if prefill_task in done and prefill_task.exception() is not None:
            main.cancel()
            raise prefill_task.exception()  # type: ignore[misc]
        if prefill_task in done:  # prefill finished fine; keep waiting for the decode side
            async with asyncio.timeout(timeout):
                return await main
        main.cancel()
        raise TimeoutError

    async def _attempt(self, ex: Exchange, shape: RequestShape, rid: str, ptoks: int, inst: Instance,
                       prefill: Instance | None, attempt: int, watch: Watch) -> None:
        r, cfg = self.r, self.r.cfg
        path = PATHS[shape.endpoint]
        auth = ex.header("authorization")
        prefill_task: asyncio.Task[None] | None = None
        pticket: Ticket | None = None
        body = ex.body
        if prefill is not None:
            fields = dict(shape.body, bootstrap_host=self.address(prefill.url).host,
                          bootstrap_port=prefill.bootstrap_port, bootstrap_room=random.getrandbits(63))
            body = dumps(fields)
            fields["stream"] = False
            fields.pop("stream_options", None)
            pticket = Ticket(prefill, ptoks, backlog_tokens(prefill))
            prefill_task = asyncio.create_task(self._prefill_side(prefill, path, rid, dumps(fields), auth, pticket))
            r.background.add(prefill_task)
            prefill_task.add_done_callback(self._prefill_finished)
            ticket = Ticket(inst, 0, 0)
        else:
            ticket = Ticket(inst, ptoks, backlog_tokens(inst))
        r.routed(shape.prompt, prefill or inst)
        watch.arm(inst, ticket, cfg.first_token_timeout_s if shape.stream else cfg.request_timeout_s,
                  cfg.request_timeout_s, cfg.stall_timeout_s)
        resp: UpstreamResponse | None = None
        try:
            try:
                head_timeout = cfg.first_token_timeout_s if shape.stream else cfg.request_timeout_s
                resp = await self._within(self._send(inst, path, rid, body, auth), prefill_task, head_timeout)
                if resp.status >= 500:
                    text = (await self._within(resp.read_all(), None, 5.0))[:300].decode(errors="replace")
                    raise BeforeFirstToken({inst.url}, f"{inst.url} answered {resp.status}: {text}")
                if not shape.stream or resp.status != 200:
                    data = await self._within(resp.read_all(), prefill_task, cfg.request_timeout_s)
                    return self._complete(ex, resp, data, shape, ticket, rid, attempt, prefill)
                first = await self._within(resp.read_some(), prefill_task, cfg.first_token_timeout_s)
                if not first:
                    raise BeforeFirstToken({inst.url}, f"{inst.url} closed the stream before the first token",
                                           crashed=True)
            except TimeoutError:
                blame = {inst.url} | ({prefill.url} if prefill is not None else set())
                raise BeforeFirstToken(blame, "no first token in time", 504) from None
            except UPSTREAM_ERRORS as exc:
                # refused: the instance was down already; anything else: it dropped this request
                raise BeforeFirstToken({inst.url}, f"{inst.url}: {exc!r}",
                                       crashed=not isinstance(exc, ConnectionRefusedError)) from None
            except asyncio.CancelledError:
                reason = _taken_back(watch)
                if reason is None:
                    raise
                if reason == "client":
                    raise ClientGone from None
                if reason == "down":
                    raise BeforeFirstToken({inst.url}, f"{inst.url} was marked down (stopped answering)") from None
                raise BeforeFirstToken({inst.url}, f"{inst.url} sent no answer in time", 504) from None
            await self._stream(ex, resp, first, shape, ticket, pticket, rid, attempt, prefill, watch)
        except BeforeFirstToken:
            if prefill_task is not None:
                prefill_task.cancel()
            raise
        finally:
            if resp is not None and not resp.complete:
                resp.close()  # closing the connection aborts the request inside SGLang
            ticket.finish()
            if pticket is not None and prefill_task is not None and prefill_task.done():
                pticket.finish()

    def _prefill_finished(self, task: asyncio.Task[None]) -> None:
        self.r.background.discard(task)
        if not task.cancelled() and task.exception() is not None:  # retrieved: no "never retrieved" noise
            log.debug("prefill side failed: %s", task.exception())

    async def _prefill_side(self, prefill: Instance, path: str, rid: str, body: bytes, auth: str | None,
                            ticket: Ticket) -> None:
        resp: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(self.r.cfg.request_timeout_s):
                resp = await self._send(prefill, path, rid, body, auth)
                data = await resp.read_all()
            if resp.status >= 500:
                raise BeforeFirstToken({prefill.url}, f"prefill {prefill.url} answered {resp.status}: "
                                       f"{data[:200].decode(errors='replace')}")
            ticket.prefill_done()
        except (*UPSTREAM_ERRORS, TimeoutError) as exc:
            ticket.finish()
            raise BeforeFirstToken({prefill.url}, f"prefill {prefill.url}: {exc!r}") from None
        except BaseException:
            ticket.finish()
            raise
        finally:
            if resp is not None and not resp.complete:
                resp.close()

    def _complete(self, ex: Exchange, resp: UpstreamResponse, data: bytes, shape: RequestShape, ticket: Ticket,
                  rid: str, attempt: int, prefill: Instance | None) -> None:
        r = self.r
        if resp.status == 200:
            completion = None
            try:
                _, completion = r.observe_usage(shape, loads(data))
            except ValueError:
                pass
            # the TTFT of a non-streamed answer is not visible: infer it from a TPOT measured on
            # streams (the instance's, else its peers'); the prefill rate learns from it only then,
            # and the TPOT never does (it would learn back the value it was inferred with)
            now = time.monotonic()
            n = completion or 1
            ref = measured_tpot(ticket.inst, r.registry.pool(ticket.inst.role))
            at = now - (n - 1) * (ref if ref is not None else ticket.inst.tpot.value)
            ttft = ticket.first_token(at=at, learn=ref is not None)
            ticket.t_last, ticket.events = now, 0
            ticket.finish()
            r.ttft_actual[Role.PREFILL if prefill else Role.PLAIN].add(ttft)
            r.metrics.ttft.observe(ttft)
        ex.reply(resp.status, data, resp.content_type, (("X-Request-Id", rid), ("X-Kllm-Instance", ticket.inst.url)))
        self._log(rid, shape, resp.status, ticket, prefill, attempt)

    async def _stream(self, ex: Exchange, resp: UpstreamResponse, first: bytes, shape: RequestShape, ticket: Ticket,
                      pticket: Ticket | None, rid: str, attempt: int, prefill: Instance | None,
                      watch: Watch) -> None:
        r = self.r
        ttft = ticket.first_token()
        if pticket is not None:
            pticket.first_token()
        r.ttft_actual[Role.PREFILL if prefill else Role.PLAIN].add(ttft)
        r.metrics.ttft.observe(ttft)
        head = (("Content-Type", resp.headers.get("content-type", "text/event-stream")),
                ("Cache-Control", "no-cache"), ("X-Request-Id", rid), ("X-Kllm-Instance", ticket.inst.url))
        status, ending = 200, b""
        # the last two pieces, still chunk-framed: the final event (usage) may straddle them
        tail = [b"", b""]
        # what the sink calls, looked up once: it runs once per token, cold (the process slept in
        # between), where every call and lookup shows; Exchange.push for framed bytes, inlined
        transport = ex.writer.transport
        buffered, closing = transport.get_write_buffer_size, transport.is_closing
        monotonic = time.monotonic

        def write(wire: bytes) -> None:  # the first piece: with the response head, in one write
            ex.start_stream(200, head, framed=wire)

        def sink(wire: bytes) -> bool:
            """Called for every piece (whole chunks of the chunked coding, relayed to the client as
            they are), from the upstream transport's callback once relaying; True when the client
            is behind. The chunk size lines cannot hold "data:" or "[DONE]": counting in the framed
            bytes counts the events. ConnectionResetError: the client left."""
            n = wire.count(b"data:")
            if b"[DONE]" in wire:
                n -= 1
            ticket.events += n
            ticket.t_last = monotonic()
            tail[0] = tail[1]
            tail[1] = wire
            try:
                write(wire)
            except RuntimeError:  # uvloop: the transport is closed
                raise ConnectionResetError("client connection is closed") from None
            return buffered() > 65536 or closing()

        try:
            if sink(chunk(first)):
                await ex.drain()
            write = transport.write  # the sink's next pieces
            try:
                await resp.relay(sink, ex.drain, framed=True)
            except SinkError as exc:
                raise ClientGone from exc
            except UPSTREAM_ERRORS as exc:
                status = 502
                log.warning("stream broke rid=%s instance=%s error=%r", rid, ticket.inst.url, exc)
                r.registry.mark_check(ticket.inst.url, False)
                ending = sse_error(f"instance failed mid-stream: {exc!r}", status)
            else:
                if not _payload(tail[1]).rstrip().endswith(b"[DONE]") and shape.endpoint != "generate":
                    status = 502
                    ending = sse_error("instance closed the stream early", status)
        except asyncio.CancelledError:
            reason = _taken_back(watch)
            if reason is None:
                raise
            if reason == "client":
                status = 499
            elif reason == "down":
                status = 502
                log.warning("stream ended rid=%s instance=%s: instance marked down", rid, ticket.inst.url)
                ending = sse_error("instance stopped answering (marked down) mid-stream", status)
            else:
                status = 504
                log.warning("stream timed out rid=%s instance=%s", rid, ticket.inst.url)
                ending = sse_error(f"instance sent nothing for {r.cfg.stall_timeout_s:g} s mid-stream"
                                   if time.monotonic() < watch.deadline else "request timed out mid-stream", status)
        except (ConnectionError, ClientGone):
            status = 499  # the client went away; closing upstream aborts the request in SGLang
        watch.disarm()
        if status != 499:
            try:
                await ex.end_stream(ending)
            except ConnectionError:
                status = 499
        if status == 499:
            self.client_left(ex, "streaming")
        else:
            ex.status = status  # counted as what the client got in the end
        r.observe_usage(shape, _last_event(_payload(tail[0] + tail[1])))
        tp = ticket.tpot()
        if tp is not None:
            r.tpot_actual[Role.DECODE if prefill else Role.PLAIN].add(tp)
            r.metrics.tpot.observe(tp)
        self._log(rid, shape, status, ticket, prefill, attempt)

    def _log(self, rid: str, shape: RequestShape, status: int, ticket: Ticket, prefill: Instance | None,
             attempt: int) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        ttft = (ticket.t_first - ticket.t0) if ticket.t_first is not None else None
        fields = {"rid": rid, "endpoint": shape.endpoint, "status": status, "instance": ticket.inst.url,
                  "prefill": prefill.url if prefill else None, "stream": shape.stream, "retries": attempt,
                  "ttft_ms": round(ttft * 1000, 2) if ttft is not None else None,
                  "total_ms": round((time.monotonic() - ticket.t0) * 1000, 2)}
        log.info("request rid=%s endpoint=%s status=%d instance=%s retries=%d", rid, shape.endpoint, status,
                 ticket.inst.url, attempt, extra={"kllm": fields})

    def close(self) -> None:
        self.pool.close()
        self.probes.close()


def _payload(wire: bytes) -> bytes:
    """The payload of whole chunks of the chunked coding (what `sink` relayed)."""
    try:
        return b"".join(ChunkedDecoder().feed(wire)) if wire else b""
    except BadHttp:  # not from feed_wire or chunk(): cannot happen
        return b""


def _last_event(tail: bytes) -> Any:
    """The last JSON `data:` event of an SSE piece (it carries usage / meta_info)."""
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if line.startswith(b"data:") and not line.endswith(b"[DONE]"):
            try:
                return loads(line[5:])
            except ValueError:
                return None
    return None
