"""Unit tests (no SGLang): the router's own HTTP/1.1 layer, on raw sockets.

Framing (chunked decoding under any split of the bytes), keep-alive and pipelining, chunked
request bodies, `Expect: 100-continue`, refusal of oversized bodies before reading them,
malformed request lines, unknown routes and methods, and the upstream pool's reuse of
connections (including one the instance closed while it sat idle).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.registry import Health
from kllm_plugins.plugins.bigpd_router.service.fake_backend import FakeBackend
from kllm_plugins.plugins.bigpd_router.service.http_wire import ChunkedDecoder, chunk, LAST_CHUNK

from test_bigpd_router_service import cluster, gen, post, run  # type: ignore[import-not-found]


@given(st.lists(st.binary(min_size=1, max_size=40), max_size=8), st.lists(st.integers(1, 30), max_size=20))
def test_chunked_decoder_reassembles_any_split(pieces: list[bytes], cuts: list[int]) -> None:
    wire = b"".join(chunk(p) for p in pieces) + b"0\r\nX-Trailer: 1\r\n\r\n"
    dec, out, pos = ChunkedDecoder(), [], 0
    for n in cuts + [len(wire)]:
        out += dec.feed(wire[pos:pos + n])
        pos += n
        if pos >= len(wire):
            break
    assert dec.done and b"".join(out) == b"".join(pieces)


async def raw(url: str, data: bytes, read_until_close: bool = False) -> bytes:
    host, port = url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    if read_until_close:
        out = await reader.read(-1)
    else:
        await asyncio.sleep(0.3)
        out = await reader.read(1 << 20)
    writer.close()
    return out


def responses(data: bytes) -> list[tuple[int, bytes]]:
    """Split pipelined Content-Length responses into (status, body)."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ")[1])
        length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
        out.append((status, rest[:length]))
        data = rest[length:]
    return out


def body_of(text: str, n: int = 2) -> bytes:
    return json.dumps(gen(text, n)).encode()


def test_keep_alive_pipelining_chunked_bodies_and_continue() -> None:
    async def go() -> None:
        fb = FakeBackend()
        async with cluster([fb], RouterConfig(loads_interval_s=0)) as (_router, rurl, _urls):
            b1, b2 = body_of("one"), body_of("two")
            req1 = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(b1), b1)
            # a chunked request body, pipelined behind the first request on the same connection
            req2 = (b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b2[:5])
                    + chunk(b2[5:]) + LAST_CHUNK)
            got = responses(await raw(rurl, req1 + req2))
            assert [s for s, _ in got] == [200, 200]
            assert [r["body"]["text"] for r in fb.requests] == ["one", "two"]
            # Expect: 100-continue is answered before the body is sent
            host, port = rurl.split("//")[1].split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(b1))
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100")
            writer.write(b1)
            rest = await reader.read(-1)
            assert rest.startswith(b"HTTP/1.1 200") and b"Connection: close" in rest
            writer.close()
    run(go)


def test_refusals_malformed_unknown_and_oversized() -> None:
    async def go() -> None:
        fb = FakeBackend()
        cfg = RouterConfig(max_body_bytes=4096, loads_interval_s=0)
        async with cluster([fb], cfg) as (_router, rurl, _urls):
            out = await raw(rurl, b"NONSENSE\r\n\r\n", read_until_close=True)
            assert out.startswith(b"HTTP/1.1 400")
            # announced too large: 413 at once, the body is never read and the connection closes
            out = await raw(rurl, b"POST /generate HTTP/1.1\r\nContent-Length: 999999\r\n\r\n", read_until_close=True)
            assert out.startswith(b"HTTP/1.1 413") and b"larger than 4096" in out
            got = responses(await raw(rurl, b"GET /nope HTTP/1.1\r\n\r\nGET /generate HTTP/1.1\r\n\r\n"))
            assert [s for s, _ in got] == [404, 405]
            assert fb.requests == []
    run(go)


def test_upstream_pool_reuses_connections_and_survives_a_stale_one() -> None:
    async def go() -> None:
        fb = FakeBackend()
        async with cluster([fb], RouterConfig(loads_interval_s=0, health_interval_s=60)) as (router, rurl, urls):
            import aiohttp

            async with aiohttp.ClientSession() as s:
                for i in range(5):
                    st, _, _ = await post(s, rurl + "/generate", gen(f"r{i}", 2, stream=bool(i % 2)))
                    assert st == 200
                pool = router.proxy.pool
                assert pool.open == 1 and pool.idle_count() == 1  # sequential requests: one connection
                # the instance closes the idle connection behind the router's back
                [conn] = [c for q in pool._idle.values() for c in q]
                conn.writer.transport.abort()
                await asyncio.sleep(0.05)
                st, _, _ = await post(s, rurl + "/generate", gen("after", 2))
                assert st == 200 and pool.open == 1
                assert router.registry.get(urls[0]).health is Health.HEALTHY  # type: ignore[union-attr]
    run(go)


def test_pd_decode_dying_mid_stream_ends_with_an_error_and_settles_both_sides() -> None:
    async def go() -> None:
        p = FakeBackend(role="prefill", bootstrap_port=9300)
        d = FakeBackend(role="decode", fail_after_events=2, tpot_s=0.02)
        async with cluster([p, d], RouterConfig(loads_interval_s=0)) as (router, rurl, urls):
            import aiohttp

            async with aiohttp.ClientSession() as s:
                st, body, _ = await post(s, rurl + "/v1/completions", {"prompt": "x" * 50, "max_tokens": 6,
                                                                       "stream": True})
            events = [ln for ln in body.split(b"\n") if ln.startswith(b"data:")]
            assert st == 200 and b'"upstream_error"' in events[-2] and events[-1] == b"data: [DONE]"
            await asyncio.sleep(0.1)
            for u in urls:
                inst: Any = router.registry.get(u)
                assert (inst.in_flight, inst.decoding, inst.pending_prefill_tokens) == (0, 0, 0)
    run(go)
