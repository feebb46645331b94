"""Push-mode relay of a chunked upstream body (`UpstreamResponse.relay`), against a raw local server,
and the router's relay of a stream on the wire: the chunks as they came, valid framing, every event."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kllm_plugins.plugins.bigpd_router.service.http_wire import LAST_CHUNK, chunk
from kllm_plugins.plugins.bigpd_router.service.upstream_pool import SinkError, UpstreamPool

EVENTS = [f"data: {i}\n\n".encode() for i in range(6)]
HEAD = b"GET /s HTTP/1.1\r\nHost: t\r\n\r\n"


async def chunked_server(cut_after: int = -1) -> tuple[asyncio.base_events.Server, int, list[int]]:
    """Answers every request on a connection with EVENTS as a chunked body, one piece per 10 ms;
    `cut_after` >= 0 closes the connection after that many pieces instead."""
    served: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                served.append(1)
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for i, ev in enumerate(EVENTS):
                    if i == cut_after:
                        writer.close()
                        return
                    writer.write(chunk(ev))
                    await writer.drain()
                    await asyncio.sleep(0.01)
                writer.write(LAST_CHUNK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, int(srv.sockets[0].getsockname()[1]), served


def run(coro: Any, loop: str = "asyncio") -> None:
    if loop == "uvloop":  # what kllm-router runs on
        pytest.importorskip("uvloop").run(asyncio.wait_for(coro, 30))
    else:
        asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_relay_pushes_every_piece_in_order_waits_for_a_slow_client_and_keeps_the_connection(loop: str) -> None:
    async def go() -> None:
        srv, port, served = await chunked_server()
        pool = UpstreamPool()
        async with srv:
            for _ in range(2):  # the second request reuses the connection: its reader is back in place
                resp = await pool.request("127.0.0.1", port, HEAD, b"")
                got = [await resp.read_some()]
                drains: list[int] = []

                def sink(piece: bytes) -> bool:
                    got.append(piece)
                    return len(got) == 2  # the client falls behind after the second piece

                async def drain() -> None:
                    before = len(got)
                    await asyncio.sleep(0.1)  # ten pieces' worth: none may be pushed meanwhile
                    drains.append(len(got) - before)

                await resp.relay(sink, drain)
                assert b"".join(got) == b"".join(EVENTS)
                assert drains == [0] and resp.complete
                assert pool.open == 1 and pool.idle_count() == 1
            assert len(served) == 2
        pool.close()
    run(go(), loop)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_relay_reports_a_cut_body_and_a_sink_that_fails(loop: str) -> None:
    async def go() -> None:
        srv, port, _ = await chunked_server(cut_after=3)
        pool = UpstreamPool()
        async with srv:
            resp = await pool.request("127.0.0.1", port, HEAD, b"")
            got = [await resp.read_some()]
            with pytest.raises(ConnectionError, match="mid-body"):
                await resp.relay(lambda p: bool(got.append(p)), asyncio.sleep)
            assert b"".join(got) == b"".join(EVENTS[:3]) and not resp.complete
            resp.close()

        srv, port, _ = await chunked_server()
        async with srv:
            resp = await pool.request("127.0.0.1", port, HEAD, b"")
            await resp.read_some()
            calls: list[bytes] = []

            def gone(piece: bytes) -> bool:
                calls.append(piece)
                raise ConnectionResetError("client connection is closed")

            with pytest.raises(SinkError):
                await resp.relay(gone, asyncio.sleep)
            await asyncio.sleep(0.1)  # later pieces are not pushed to a sink that failed
            assert len(calls) == 1
            resp.close()
        assert pool.open == 0
    run(go(), loop)


# ---------------------------------------------------------------- through the router, on the wire
def _strict_chunks(raw: bytes) -> tuple[list[bytes], bytes]:
    """A chunked body read to the letter (plain lower-case hex sizes, CRLF after each chunk, no
    trailers): its chunks' payloads and whatever follows the last chunk."""
    import re

    pos, out = 0, []
    while True:
        end = raw.index(b"\r\n", pos)
        line = raw[pos:end]
        assert re.fullmatch(rb"[0-9a-f]+", line), f"bad size line {line!r} at {pos}"
        size = int(line, 16)
        if size == 0:
            assert raw[end + 2:end + 4] == b"\r\n", "the last chunk must end the body (no trailers)"
            return out, raw[end + 4:]
        data = raw[end + 2:end + 2 + size]
        assert len(data) == size and raw[end + 2 + size:end + 4 + size] == b"\r\n", f"chunk at {pos} cut"
        out.append(data)
        pos = end + 4 + size


EV = [b'data: {"text": "a", "meta_info": {"completion_tokens": 1}}\n\n',
      b'data: {"text": "ab", "meta_info": {"completion_tokens": 2}}\n\n',
      b'data: {"text": "abc", "meta_info": {"completion_tokens": 3}}\n\n',
      b'data: {"text": "abcd", "meta_info": {"completion_tokens": 4}}\n\n',
      b'data: {"text": "abcde", "meta_info": {"prompt_tokens": 7, "completion_tokens": 5, "cached_tokens": 3}}\n\n',
      b"data: [DONE]\n\n"]
# one write each (10 ms apart, so one read each at the router): how SGLang's server frames events
# (a plain chunk per event), and what it might also do: an event split over two chunks, upper-case
# hex with a chunk extension, a chunk that comes in two reads, two events in one read
WRITES = [[chunk(EV[0])],
          [chunk(EV[1][:20]), chunk(EV[1][20:])],
          [b"%X;ext=1\r\n%b\r\n" % (len(EV[2]), EV[2])],
          [chunk(EV[3])[:15]], [chunk(EV[3])[15:]],
          [chunk(EV[4]) + chunk(EV[5]) + LAST_CHUNK]]


async def sse_upstream(writes: list[list[bytes]], gap_s: float = 0.01
                       ) -> tuple[asyncio.base_events.Server, str, dict[str, Any]]:
    """A raw HTTP/1.1 instance: any GET is answered 200 (probes), a POST with a chunked stream made
    of `writes`; `seen` tells whether the router closed the stream's connection before its end."""
    seen: dict[str, Any] = {"posts": 0, "closed_early": asyncio.Event()}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                    continue
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                seen["posts"] += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                for parts in writes:
                    await asyncio.sleep(gap_s)
                    if reader.at_eof() or writer.is_closing():
                        seen["closed_early"].set()
                        return
                    for p in parts:
                        writer.write(p)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            if seen["posts"]:
                seen["closed_early"].set()
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", seen


async def _stream_request(port: int, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]
                          ) -> tuple[bytes, bytes]:
    reader, writer = conn
    body = json.dumps({"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 5}}).encode()
    writer.write(b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    raw = b""
    while not raw.endswith(b"\r\n0\r\n\r\n"):
        raw += await reader.read(65536)
    return head, raw


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_router_relays_a_stream_byte_exact_with_valid_chunks_and_sees_every_event(
        loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import REGISTRY

    from kllm_plugins.plugins.bigpd_router.config import RouterConfig
    from kllm_plugins.plugins.bigpd_router.core.registry import Health, Instance, Role
    from kllm_plugins.plugins.bigpd_router.service import proxy
    from kllm_plugins.plugins.bigpd_router.service.router import Router

    tickets: list[Any] = []

    class Spy(proxy.Ticket):  # type: ignore[misc,valid-type]
        def __post_init__(self) -> None:
            super().__post_init__()
            tickets.append(self)

    monkeypatch.setattr(proxy, "Ticket", Spy)

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    async def go() -> None:
        srv, url, seen = await sse_upstream(WRITES)
        router = Router(RouterConfig(health_interval_s=0.2, loads_interval_s=0))
        async with srv, router.serving() as rurl:
            inst = Instance(url=url, role=Role.PLAIN)
            inst.health = Health.HEALTHY
            router.registry.add(inst)
            port = int(rurl.rsplit(":", 1)[1])
            prompt0, cached0 = sample("kllm_bigpd_router_prompt_tokens_total"), \
                sample("kllm_bigpd_router_cached_tokens_total")
            conn = await asyncio.open_connection("127.0.0.1", port)
            for rnd in range(2):  # the second on the same client connection: nothing was left behind
                head, raw = await _stream_request(port, conn)
                assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
                chunks, rest = _strict_chunks(raw)
                assert rest == b""
                assert b"".join(chunks) == b"".join(EV)  # the events, [DONE] last, nothing added or lost
                assert chunk(EV[0]) in raw and chunk(EV[4]) + chunk(EV[5]) in raw  # plain chunks as they came
                assert tickets[-1].events == 5  # [DONE] is not an event
                assert sample("kllm_bigpd_router_prompt_tokens_total") == prompt0 + 7 * (rnd + 1)  # usage seen
                assert sample("kllm_bigpd_router_cached_tokens_total") == cached0 + 3 * (rnd + 1)
                # the body's end was found exactly: the upstream connection went back to the pool
                for _ in range(50):
                    if router.proxy.pool.idle_count() >= 1:
                        break
                    await asyncio.sleep(0.01)
                assert router.proxy.pool.idle_count() >= 1
            conn[1].close()
            assert seen["posts"] == 2 and not seen["closed_early"].is_set()
    run(go(), loop)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_router_stream_client_that_leaves_is_499_and_closes_upstream_bad_chunk_ends_cleanly(loop: str) -> None:
    from prometheus_client import REGISTRY

    from kllm_plugins.plugins.bigpd_router.config import RouterConfig
    from kllm_plugins.plugins.bigpd_router.core.registry import Health, Instance, Role
    from kllm_plugins.plugins.bigpd_router.service.router import Router

    def n499() -> float:
        return REGISTRY.get_sample_value("kllm_bigpd_router_requests_total",
                                         {"endpoint": "generate", "status": "499"}) or 0.0

    async def go() -> None:
        many = [[chunk(b"data: {\"text\": \"t%d\"}\n\n" % i)] for i in range(200)]  # ~4 s of events
        srv, url, seen = await sse_upstream(many, gap_s=0.02)
        bad = [[chunk(EV[0])], [chunk(EV[1])], [b"zz\r\nnot a chunk\r\n"]]
        srv2, url2, _ = await sse_upstream(bad)
        router = Router(RouterConfig(health_interval_s=0.2, loads_interval_s=0))
        async with srv, srv2, router.serving() as rurl:
            port = int(rurl.rsplit(":", 1)[1])
            inst = Instance(url=url, role=Role.PLAIN)
            inst.health = Health.HEALTHY
            router.registry.add(inst)
            before = n499()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = json.dumps({"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 200}}).encode()
            writer.write(b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
            await reader.readuntil(b"\r\n\r\n")
            await reader.read(100)  # the stream has started
            writer.close()
            await asyncio.wait_for(seen["closed_early"].wait(), 3.0)  # the upstream request was aborted
            for _ in range(100):
                if n499() == before + 1:
                    break
                await asyncio.sleep(0.02)
            assert n499() == before + 1 and inst.in_flight == 0

            router.registry.remove(url)
            inst2 = Instance(url=url2, role=Role.PLAIN)
            inst2.health = Health.HEALTHY
            router.registry.add(inst2)
            conn = await asyncio.open_connection("127.0.0.1", port)
            head, raw = await _stream_request(port, conn)
            chunks, rest = _strict_chunks(raw)  # still a valid chunked body
            payload = b"".join(chunks)
            assert rest == b"" and payload.startswith(EV[0] + EV[1])
            assert b"bad chunked body" in payload and payload.endswith(b"data: [DONE]\n\n")
            conn[1].close()
    run(go(), loop)
