"""Layer: service (no SGLang import). Pooled keep-alive HTTP/1.1 connections to the instances.

Each instance (host, port) keeps a stack of idle connections; a request takes the most recently
used one (warm socket) or opens a new one, writes head and body in one call, and hands back an
`UpstreamResponse` whose body is read as the caller needs it: whole (non-streamed answers) or
piece by piece (streams). A connection goes back to the pool only when its response was read
to the end; anything else closes it, which is also how an abandoned stream aborts the request
inside SGLang. A reused connection that the instance had already closed fails before any byte
of a response: that one case is retried once on a fresh connection.
"""
from __future__ import annotations

import asyncio
import collections
import socket
import time

from kllm_plugins.plugins.bigpd_router.service.http_wire import (
    MAX_HEAD_BYTES,
    BadHttp,
    ChunkedDecoder,
    body_length,
    parse_response_head,
)

READ_SIZE = 65536


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
