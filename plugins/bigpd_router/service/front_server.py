"""Layer: service (no SGLang import). The client-facing HTTP/1.1 server of kllm-router.

One task per client connection reads requests one after the other (keep-alive, pipelining by
order), hands each to the router as an `Exchange` and writes the answer straight to the socket:
a whole response in one write, or a chunked stream. Bodies larger than the limit are refused
before they are read. Shutdown stops accepting, closes idle keep-alive connections at once and
lets requests in flight finish (up to a timeout).

Hostile clients: a request head must arrive within `header_timeout_s` and its body within
`body_timeout_s` (HTTP 408, then close), an idle keep-alive connection is closed after
`idle_timeout_s`, and one client address may hold at most `max_per_client` connections. A client
that resets its connection is a disconnect like a close (uvloop reports writes to a closed
transport as RuntimeError, asyncio as ConnectionError: both become ConnectionResetError here).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any, Awaitable, Callable, Iterable

try:
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover - orjson ships with SGLang
    import json

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj).encode()

from kllm_plugins.plugins.bigpd_router.service.http_wire import (
    LAST_CHUNK,
    MAX_HEAD_BYTES,
    BadHttp,
    ChunkedDecoder,
    RequestHead,
    body_length,
    chunk,
    parse_request_head,
    response_head,
)

log = logging.getLogger("kllm.bigpd_router.front")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        writer.write(data)
    except RuntimeError:  # uvloop: "unable to perform operation on <TCPTransport closed=True>"
        raise ConnectionResetError("client connection is closed") from None


async def _drain(writer: asyncio.StreamWriter) -> None:
    try:
        await writer.drain()
    except RuntimeError:
        raise ConnectionResetError("client connection is closed") from None


class Exchange:
    """One request and the means to answer it, once (whole or as a stream)."""

    __slots__ = ("head", "body", "writer", "reader", "status", "streaming", "keep_alive", "refused")

    def __init__(self, head: RequestHead, body: bytes, writer: asyncio.StreamWriter, keep_alive: bool,
                 reader: asyncio.StreamReader | None = None) -> None:
        self.head = head
        self.body = body
        self.writer = writer
        self.reader = reader
        self.status = 0
        self.streaming = False
        self.keep_alive = keep_alive
        self.refused: tuple[int, str] | None = None
        """Set by the server when it would not read the body (too large, unreadable): answer this."""

    @property
    def answered(self) -> bool:
        return self.status != 0

    def client_gone(self) -> bool:
        """The client closed or reset its connection (seen without reading from it)."""
        if self.writer.is_closing():
            return True
        r = self.reader
        return r is not None and (r.at_eof() or r.exception() is not None)

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.head.headers.get(name, default)

    def reply(self, status: int, body: bytes, content_type: str = "application/json",
              headers: Iterable[tuple[str, str]] = ()) -> None:
        self.status = status
        _write(self.writer, response_head(status, [("Content-Type", content_type), *headers], len(body),
                                          self.keep_alive) + body)

    def reply_json(self, status: int, obj: Any, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.reply(status, dumps(obj), "application/json", headers)

    def start_stream(self, status: int, headers: Iterable[tuple[str, str]], framed: bytes = b"") -> None:
        """The response head of a chunked stream, with its first piece (`framed`: whole chunks of the
        chunked coding) in the same write. The stream's next pieces go to the transport as they
        are (the proxy's sink); `end_stream` ends it."""
        self.status = status
        self.streaming = True
        _write(self.writer, response_head(status, headers, None, self.keep_alive) + framed)

    async def drain(self) -> None:
        await _drain(self.writer)

    async def end_stream(self, data: bytes = b"") -> None:
        _write(self.writer, chunk(data) + LAST_CHUNK if data else LAST_CHUNK)
        await _drain(self.writer)


Handler = Callable[[Exchange], Awaitable[None]]


class FrontServer:
    def __init__(self, handler: Handler, max_body_bytes: int, header_timeout_s: float = 10.0,
                 body_timeout_s: float = 30.0, idle_timeout_s: float = 30.0, max_per_client: int = 0,
                 count: Callable[[str], None] | None = None) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_per_client = max_per_client
        self.count = count or (lambda event: None)
        """Called with "header_timeout", "body_timeout", "idle_timeout", "client_cap", "reset"."""
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.closing = False
        self._idle: set[asyncio.StreamWriter] = set()
        self._busy = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._per_client: dict[str, int] = {}

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._client, host, port, limit=MAX_HEAD_BYTES, backlog=4096,
                                                 reuse_address=True)
        self.port = int(self.server.sockets[0].getsockname()[1])
        return self.port

    @property
    def connections(self) -> int:
        return len(self._writers)

    async def _read_body(self, head: RequestHead, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> tuple[bytes, tuple[int, str] | None]:
        try:
            length = body_length(head.headers)
        except BadHttp as exc:
            return b"", (400, str(exc))
        if length is not None and length > self.max_body_bytes:
            return b"", (413, f"body larger than {self.max_body_bytes} bytes")
        if head.headers.get("expect", "").lower() == "100-continue":
            writer.write(CONTINUE)
        if length is not None:
            if length <= 0:
                return b"", None
            async with asyncio.timeout(self.body_timeout_s):
                return await reader.readexactly(length), None
        async with asyncio.timeout(self.body_timeout_s):
            return await self._read_chunked(reader)

    async def _read_chunked(self, reader: asyncio.StreamReader) -> tuple[bytes, tuple[int, str] | None]:
        dec, parts, size = ChunkedDecoder(), [], 0
        while not dec.done:
            data = await reader.read(65536)
            if not data:
                raise asyncio.IncompleteReadError(b"", None)
            for piece in dec.feed(data):
                size += len(piece)
                parts.append(piece)
            if size > self.max_body_bytes:
                return b"", (413, f"body larger than {self.max_body_bytes} bytes")
        return b"".join(parts), None

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = writer.get_extra_info("peername")
        addr = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        held = self._per_client.get(addr, 0) + 1
        self._per_client[addr] = held
        self._writers.add(writer)
        try:
            if self.max_per_client and held > self.max_per_client:
                self.count("client_cap")
                with contextlib.suppress(Exception):  # read the head: closing on unread input would reset
                    async with asyncio.timeout(min(1.0, self.header_timeout_s)):
                        await reader.readuntil(b"\r\n\r\n")
                msg = b"too many connections from this address"
                _write(writer, response_head(503, [("Content-Type", "text/plain")], len(msg), False) + msg)
                return
            first = True
            while not self.closing:
                self._idle.add(writer)
                try:
                    # the first head must come within header_timeout_s; a kept-alive connection waits
                    # idle_timeout_s for its next one (the whole head, so a trickle cannot hold it)
                    async with asyncio.timeout(self.header_timeout_s if first else self.idle_timeout_s):
                        raw = await reader.readuntil(b"\r\n\r\n")
                except TimeoutError:
                    self.count("header_timeout" if first else "idle_timeout")
                    if first:
                        _write(writer, response_head(408, [], 0, False))
                    return
                except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
                    return
                except (asyncio.LimitOverrunError, ValueError):
                    _write(writer, response_head(431, [], 0, False))
                    return
                finally:
                    self._idle.discard(writer)
                first = False
                self._busy += 1
                try:
                    if not await self._one(raw, reader, writer):
                        return
                finally:
                    self._busy -= 1
        except ConnectionError:
            self.count("reset")
        finally:
            self._writers.discard(writer)
            left = self._per_client.get(addr, 1) - 1
            if left > 0:
                self._per_client[addr] = left
            else:
                self._per_client.pop(addr, None)
            try:
                writer.close()
            except RuntimeError:  # uvloop, transport already gone
                pass

    async def _one(self, raw: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection must not be reused."""
        try:
            head = parse_request_head(raw)
        except BadHttp as exc:
            _write(writer, response_head(400, [("Content-Type", "text/plain")], len(str(exc)), False)
                   + str(exc).encode())
            return False
        try:
            body, refused = await self._read_body(head, reader, writer)
        except TimeoutError:
            self.count("body_timeout")
            _write(writer, response_head(408, [], 0, False))
            return False
        except (asyncio.IncompleteReadError, ConnectionError):
            return False
        except BadHttp as exc:
            body, refused = b"", (400, str(exc))
        ex = Exchange(head, body, writer, head.keep_alive and refused is None and not self.closing, reader)
        ex.refused = refused
        try:
            await self.handler(ex)
        except (ConnectionError, asyncio.IncompleteReadError):
            return False
        except Exception:
            log.exception("handler failed path=%s", head.path)
            if ex.answered:
                return False
            ex.keep_alive = False
            ex.reply_json(500, {"error": {"message": "internal router error", "type": "internal_error",
                                          "code": 500}})
        if not ex.answered:
            ex.reply(500, b"", "text/plain")
        if ex.status == 499:  # the client left; nothing was written
            return False
        await _drain(writer)
        return ex.keep_alive

    async def shutdown(self, timeout_s: float) -> None:
        """Stop accepting, close idle connections, wait up to timeout_s for requests in flight."""
        self.closing = True
        if self.server is not None:
            self.server.close()
        for w in list(self._idle):
            with contextlib.suppress(RuntimeError):
                w.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._busy and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for w in list(self._writers):
            with contextlib.suppress(RuntimeError):
                w.close()
        if self.server is not None:
            try:
                await asyncio.wait_for(self.server.wait_closed(), 1.0)
            except asyncio.TimeoutError:
                pass
