"""Layer: service (no SGLang import). Pooled keep-alive HTTP/1.1 connections to the instances.

Each instance (host, port) keeps a stack of idle connections; a request takes the most recently
used one (warm socket) or opens a new one, writes head and body in one call, and hands back an
`UpstreamResponse` whose body is read as the caller needs it: whole (non-streamed answers) or
piece by piece (streams). A connection goes back to the pool only when its response was read
to the end; anything else closes it, which is also how an abandoned stream aborts the request
inside SGLang. A reused connection that the instance had already closed fails before any byte
of a response: that one case is retried once on a fresh connection.

A chunked stream can also be relayed in push mode (`UpstreamResponse.relay`): for the rest of the
body the connection's transport hands each read to a small protocol that decodes the framing and
passes the pieces to a sink at once, from the transport's callback. The handler task then sleeps
until the body ends (or the sink asks it to wait for a slow client) instead of being woken, and
resuming a chain of coroutines, once per token.
"""
from __future__ import annotations

import asyncio
import collections
import socket
import time
from typing import Awaitable, Callable

from kllm_plugins.plugins.bigpd_router.service.http_wire import (
    MAX_HEAD_BYTES,
    BadHttp,
    ChunkedDecoder,
    body_length,
    chunk,
    parse_response_head,
)

READ_SIZE = 65536


class SinkError(Exception):
    """The sink of a relayed stream raised (the client is gone); `__cause__` holds its error."""


async def _drain(drain: Callable[[], Awaitable[object]]) -> None:
    try:
        await drain()
    except ConnectionError as exc:  # the client's side, not the instance's
        raise SinkError("the sink's drain failed") from exc


class _Relay(asyncio.Protocol):
    """Push mode of one upstream connection while a chunked body is relayed (see `UpstreamResponse.relay`).

    Stands in for the connection's StreamReaderProtocol, hands eof and loss on to it (so the
    connection's state stays right for the pool) and is swapped back out when the body ends."""

    __slots__ = ("resp", "sink", "framed", "dec", "transport", "orig", "waiter", "over", "error")

    def __init__(self, resp: UpstreamResponse, sink: Callable[[bytes], bool], transport: asyncio.Transport,
                 orig: asyncio.BaseProtocol, framed: bool = False) -> None:
        self.resp = resp
        self.sink: Callable[[bytes], bool] | None = sink
        self.framed = framed
        self.dec = resp._chunks
        assert self.dec is not None
        self.transport = transport
        self.orig = orig
        self.waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.over = False
        self.error: BaseException | None = None

    def _wake(self, behind: bool) -> None:
        if not self.waiter.done():
            self.waiter.set_result(behind)

    def _end(self, exc: BaseException | None) -> None:
        """Stop pushing: the body is complete (exc None) or broken."""
        if self.over:
            return
        self.over, self.sink, self.error = True, None, exc
        if exc is None:
            self.transport.set_protocol(self.orig)  # the reader reads the connection's next response
        self._wake(False)

    def data_received(self, data: bytes) -> None:
        # once per token, run cold (the process slept since the last one): kept short on purpose
        sink = self.sink
        if sink is None:  # ended: nothing more goes to the client
            return
        dec = self.dec
        try:
            if self.framed:  # the chunks as they came (see ChunkedDecoder.feed_wire)
                wire = dec.feed_wire(data)
                behind = sink(wire) if wire else False
            else:
                pieces = dec.feed(data)
                behind = bool(pieces) and sink(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        except BadHttp as exc:
            return self._end(ConnectionError(f"instance sent a bad chunked body: {exc}"))
        except ConnectionError as exc:
            err = SinkError("the sink refused a piece")
            err.__cause__ = exc
            return self._end(err)
        except Exception as exc:  # a bug in the sink: surfaces in the handler, not in the event loop
            return self._end(exc)
        if dec.done:
            self.resp._relay_done(trailing=bool(dec._buf))
            return self._end(None)
        if behind:
            self.transport.pause_reading()
            self._wake(True)

    def eof_received(self) -> bool | None:
        self.orig.eof_received()  # type: ignore[attr-defined]
        self._end(ConnectionError("instance closed the connection mid-body"))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.orig.connection_lost(exc)
        self._end(ConnectionError("instance closed the connection mid-body"))


class UpstreamConn:
    __slots__ = ("key", "reader", "writer", "idle_since")

    def __init__(self, key: tuple[str, int, bool], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.key = key
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


class UpstreamResponse:
    """One response being read from an upstream connection."""

    __slots__ = ("status", "headers", "_conn", "_pool", "_left", "_chunks", "_until_close", "complete")

    def __init__(self, status: int, headers: dict[str, str], conn: UpstreamConn, pool: UpstreamPool,
                 length: int | None, no_body: bool) -> None:
        self.status = status
        self.headers = headers
        self._conn: UpstreamConn | None = conn
        self._pool = pool
        self._chunks = ChunkedDecoder() if length is None else None
        self._until_close = length == -1 and not no_body
        self._left = 0 if no_body or length is None or length < 0 else length
        self.complete = no_body or length == 0
        if self.complete:
            self._give_back()

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/json")

    def _give_back(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(conn, reusable=self.complete and not self._until_close
                               and "close" not in self.headers.get("connection", "").lower())

    async def read_some(self) -> bytes:
        """The next piece of the body, b"" once it is complete. Raises ConnectionError if it is cut."""
        conn = self._conn
        if self.complete or conn is None:
            return b""
        while True:
            data = await conn.reader.read(READ_SIZE)
            if not data:
                if self._until_close:
                    self.complete = True
                    self._give_back()
                    return b""
                self.close()
                raise ConnectionError("instance closed the connection mid-body")
            if self._chunks is not None:
                pieces = self._chunks.feed(data)
                if self._chunks.done:
                    self.complete = True
                    self._give_back()
                if pieces:
                    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
                if self.complete:
                    return b""
                continue
            if self._until_close:
                return data
            if len(data) > self._left:
                self.close()
                raise ConnectionError("instance sent more than Content-Length")
            self._left -= len(data)
            if self._left == 0:
                self.complete = True
                self._give_back()
            return data

    async def read_all(self) -> bytes:
        conn = self._conn
        if conn is not None and self._chunks is None and not self._until_close and self._left:
            try:
                data = await conn.reader.readexactly(self._left)
            except asyncio.IncompleteReadError:
                self.close()
                raise ConnectionError("instance closed the connection mid-body") from None
            self._left = 0
            self.complete = True
            self._give_back()
            return data
        parts = []
        while True:
            piece = await self.read_some()
            if not piece:
                return b"".join(parts)
            parts.append(piece)

    def _relay_done(self, trailing: bool) -> None:
        self.complete = True
        if trailing:  # bytes after the last chunk: the connection is not in a known state
            self.close()
        else:
            self._give_back()

    async def relay(self, sink: Callable[[bytes], bool], drain: Callable[[], Awaitable[object]],
                    framed: bool = False) -> None:
        """Hand every further piece of the body to `sink(piece)` as it arrives; returns once the body
        is complete. A chunked body is pushed from the transport's callback (no task wake-up per
        piece); others are read piece by piece. `sink` returns True when its client is behind:
        reading pauses until `await drain()` returns. Raises SinkError when `sink` raised
        ConnectionError (nothing more is pushed), ConnectionError when the body is cut.
        `framed`: the pieces are in the chunked coding (whole chunks, never the last one), ready for
        a chunked response: a chunked body's chunks go on as they came, with no decoding and
        re-encoding (`ChunkedDecoder.feed_wire`), other bodies' pieces are framed here."""
        reader = self._conn.reader if self._conn is not None else None
        while not self.complete and reader is not None and (
                self._chunks is None or reader._buffer or reader.at_eof() or reader.exception() is not None):  # noqa: SLF001
            # what the reader already holds (or a body that is not chunked) goes the ordinary way
            piece = await self.read_some()
            if piece:
                try:
                    behind = sink(chunk(piece) if framed else piece)
                except ConnectionError as exc:
                    raise SinkError("the sink refused a piece") from exc
                if behind:
                    await _drain(drain)
        conn = self._conn
        if self.complete or conn is None:
            return
        transport = conn.writer.transport
        relay = _Relay(self, sink, transport, transport.get_protocol(), framed)
        transport.set_protocol(relay)
        try:
            while await relay.waiter:  # True: the client is behind (reading is paused)
                await _drain(drain)
                if relay.over:
                    break
                relay.waiter = asyncio.get_running_loop().create_future()
                transport.resume_reading()
        finally:
            if not relay.over:  # cancelled, or the drain failed: push nothing more; the caller closes
                relay.over, relay.sink = True, None
        if relay.error is not None:
            raise relay.error

    def close(self) -> None:
        """Abandon the response: the connection is closed, not reused."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.discard(conn)


class UpstreamPool:
    def __init__(self, max_idle_per_host: int = 256, idle_timeout_s: float = 30.0) -> None:
        self.max_idle_per_host = max_idle_per_host
        self.idle_timeout_s = idle_timeout_s
        self._idle: dict[tuple[str, int, bool], collections.deque[UpstreamConn]] = {}
        self.open = 0
        """Connections open now (idle or busy)."""
        self.closed = False

    def idle_count(self) -> int:
        return sum(len(q) for q in self._idle.values())

    async def _connect(self, key: tuple[str, int, bool]) -> UpstreamConn:
        reader, writer = await asyncio.open_connection(key[0], key[1], limit=MAX_HEAD_BYTES, ssl=key[2] or None)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.open += 1
        return UpstreamConn(key, reader, writer)

    def _take_idle(self, key: tuple[str, int, bool]) -> UpstreamConn | None:
        q = self._idle.get(key)
        while q:
            conn = q.pop()
            if conn.usable():
                return conn
            self.discard(conn)
        return None

    def release(self, conn: UpstreamConn, reusable: bool) -> None:
        if not reusable or self.closed or not conn.usable():
            self.discard(conn)
            return
        q = self._idle.setdefault(conn.key, collections.deque())
        if len(q) >= self.max_idle_per_host:
            self.discard(conn)
            return
        conn.idle_since = time.monotonic()
        q.append(conn)

    def discard(self, conn: UpstreamConn) -> None:
        if not conn.writer.is_closing():
            conn.close()
        self.open -= 1

    async def request(self, host: str, port: int, head: bytes, body: bytes, no_body: bool = False,
                      tls: bool = False) -> UpstreamResponse:
        """Send one request (head already built, ending with the blank line) and read the response head."""
        key = (host, port, tls)
        conn = self._take_idle(key)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(key)
        while True:
            try:
                conn.writer.write(head + body if len(body) < 65536 else head)
                if len(body) >= 65536:
                    conn.writer.write(body)
                raw = await conn.reader.readuntil(b"\r\n\r\n")
                break
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                self.discard(conn)
                partial = exc.partial if isinstance(exc, asyncio.IncompleteReadError) else b""
                if reused and not partial:  # a stale keep-alive connection: try a fresh one once
                    reused = False
                    conn = await self._connect(key)
                    continue
                raise ConnectionError(f"{host}:{port} closed the connection before answering") from None
            except (asyncio.LimitOverrunError, ValueError):
                self.discard(conn)
                raise ConnectionError(f"{host}:{port} sent a response head over {MAX_HEAD_BYTES} bytes") from None
            except BaseException:
                self.discard(conn)
                raise
        try:
            status, headers = parse_response_head(raw)
            length = body_length(headers)
        except BadHttp as exc:
            self.discard(conn)
            raise ConnectionError(f"{host}:{port}: {exc}") from None
        return UpstreamResponse(status, headers, conn, self, length, no_body or status in (204, 304))

    def prune(self) -> None:
        """Close connections idle for longer than idle_timeout_s."""
        horizon = time.monotonic() - self.idle_timeout_s
        for q in self._idle.values():
            while q and q[0].idle_since < horizon:
                self.discard(q.popleft())

    def close(self) -> None:
        self.closed = True
        for q in self._idle.values():
            while q:
                self.discard(q.pop())
        self._idle.clear()
