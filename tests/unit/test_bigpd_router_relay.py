"""Push-mode relay of a chunked upstream body (`UpstreamResponse.relay`), against a raw local server."""
from __future__ import annotations

import asyncio
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
