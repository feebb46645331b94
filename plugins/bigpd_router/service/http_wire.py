"""Layer: service (no SGLang import). HTTP/1.1 on the wire: the little the router needs of it.

Request and response heads are parsed from the bytes up to the blank line; bodies are framed by
Content-Length, chunked transfer coding, or (responses only) the end of the connection. Nothing
here does I/O: `front_server` and `upstream_pool` feed it bytes and write what it builds, so a
proxied request costs one parse of each head and no copy of the body beyond the socket buffers.
"""
from __future__ import annotations

from typing import Iterable

REASONS = {100: "Continue", 200: "OK", 201: "Created", 202: "Accepted", 204: "No Content",
           400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
           409: "Conflict", 413: "Payload Too Large", 431: "Request Header Fields Too Large", 499: "Client Closed Request", 500: "Internal Server Error",
           502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}
MAX_HEAD_BYTES = 64 * 1024


class BadHttp(ValueError):
    """The peer sent something that is not HTTP/1.x we can read; the connection is not reused."""


class RequestHead:
    __slots__ = ("method", "path", "query", "version", "headers", "keep_alive")

    def __init__(self, method: str, path: str, query: str, version: str, headers: dict[str, str]) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.version = version
        self.headers = headers
        conn = headers.get("connection", "").lower()
        self.keep_alive = ("close" not in conn) if version == "HTTP/1.1" else ("keep-alive" in conn)


def _headers(lines: list[bytes]) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise BadHttp(f"malformed header line {line[:80]!r}")
        key = name.decode("latin-1").lower()
        val = value.strip().decode("latin-1")
        out[key] = f"{out[key]}, {val}" if key in out else val
    return out


def parse_request_head(data: bytes) -> RequestHead:
    """`data` ends with the blank line (CRLF CRLF)."""
    lines = data.rstrip(b"\r\n").split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise BadHttp(f"malformed request line {lines[0][:80]!r}")
    target = parts[1].decode("latin-1")
    path, _, query = target.partition("?")
    return RequestHead(parts[0].decode("latin-1"), path, query, parts[2].decode("latin-1"), _headers(lines[1:]))


def parse_response_head(data: bytes) -> tuple[int, dict[str, str]]:
    lines = data.rstrip(b"\r\n").split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise BadHttp(f"malformed status line {lines[0][:80]!r}")
    return int(parts[1]), _headers(lines[1:])


def body_length(headers: dict[str, str]) -> int | None:
    """Content-Length, or None when the body is chunked; raises on a value that is not a length."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return None
    raw = headers.get("content-length")
    if raw is None:
        return -1
    if not raw.isdigit():
        raise BadHttp(f"bad Content-Length {raw!r}")
    return int(raw)


def response_head(status: int, headers: Iterable[tuple[str, str]], length: int | None,
                  keep_alive: bool = True) -> bytes:
    """Status line and headers; `length` None means a chunked body follows."""
    out = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"]
    out.extend(f"{k}: {v}" for k, v in headers)
    out.append("Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}")
    if not keep_alive:
        out.append("Connection: close")
    return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


class ChunkedDecoder:
    """Incremental decoder of a chunked body: feed bytes, get payload pieces; `done` after the last chunk."""

    __slots__ = ("_buf", "_left", "done", "_state")

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0
        self._state = 0  # 0: size line, 1: data, 2: CRLF after data, 3: trailers
        self.done = False

    def _size(self, line: bytes) -> int:
        """The size on a chunk's size line (extensions and blanks allowed, as `feed` reads it)."""
        size_txt = line.split(b";", 1)[0].strip()
        try:
            size = int(size_txt, 16)
        except ValueError:
            raise BadHttp(f"bad chunk size {size_txt[:20]!r}") from None
        if size < 0:
            raise BadHttp(f"bad chunk size {size_txt[:20]!r}")
        return size

    def feed_wire(self, data: bytes) -> bytes:
        """Like `feed`, but what it hands on is still in the chunked coding, ready to be written to a
        chunked response as it is: the chunks that arrived whole go on byte for byte, in one slice of
        the input (no copy of their data when the input is all whole chunks, as a streaming server
        writes them: one event per chunk), while a chunk not complete yet, or one whose size line is
        not plain lower-case hex (extensions, upper case, leading zeros), goes on re-framed as
        chunks of its own. The last chunk and any trailers are not handed on (the relaying side ends
        its body itself); the payload of the result is exactly what `feed` would have returned, and
        it always ends on a chunk boundary, so the relaying side may add chunks of its own at any time."""
        if self._state == 0 and not self._buf:  # the usual read of a stream: one whole event chunk
            end = data.find(b"\r\n")
            size = len(data) - end - 4  # if it is one chunk, and its size line says so, plainly
            if end > 0 and size > 0 and data[:end] == b"%x" % size and data[-2:] == b"\r\n":
                return data
        buf = self._buf + data if self._buf else data
        n = len(buf)
        pos = 0
        start = 0 if self._state == 0 else -1  # where the run of whole chunks handed on as they are began
        out: list[bytes] = []
        while pos < n and not self.done:
            state = self._state
            if state == 0:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > 1024:
                        raise BadHttp("chunk size line too long")
                    break
                line = buf[pos:end]
                try:
                    size = int(line, 16)
                    plain = size > 0 and b"%x" % size == line
                except ValueError:
                    size, plain = self._size(line), False
                stop = end + 2 + size
                if plain and stop + 2 <= n:  # whole, plainly framed: the run goes on
                    if buf[stop:stop + 2] != b"\r\n":
                        raise BadHttp("chunk not followed by CRLF")
                    pos = stop + 2
                    continue
                if size < 0:
                    raise BadHttp(f"bad chunk size {line[:20]!r}")
                if start >= 0 and start < pos:
                    out.append(buf[start:pos])
                start = -1
                pos = end + 2
                self._left = size
                self._state = 1 if size else 3
            elif state == 1:
                take = min(self._left, n - pos)
                out.append(b"%x\r\n%b\r\n" % (take, buf[pos:pos + take]))
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = 2
            elif state == 2:
                if n - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise BadHttp("chunk not followed by CRLF")
                pos += 2
                self._state = 0
                start = pos
            else:  # trailers until an empty line
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                if end == pos:
                    self.done = True
                pos = end + 2
        if start >= 0 and start < pos and self._state == 0:
            out.append(buf[start:pos])
        self._buf = buf[pos:] if pos < n else b""
        if len(out) == 1:
            return out[0]
        return b"".join(out)

    def feed(self, data: bytes) -> list[bytes]:
        out: list[bytes] = []
        buf = self._buf + data if self._buf else data
        pos = 0
        n = len(buf)
        while pos < n and not self.done:
            if self._state == 0:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > 1024:
                        raise BadHttp("chunk size line too long")
                    break
                self._left = self._size(buf[pos:end])
                pos = end + 2
                self._state = 1 if self._left else 3
            elif self._state == 1:
                take = min(self._left, n - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = 2
            elif self._state == 2:
                if n - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise BadHttp("chunk not followed by CRLF")
                pos += 2
                self._state = 0
            else:  # trailers until an empty line
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                if end == pos:
                    self.done = True
                pos = end + 2
        self._buf = buf[pos:]
        return out
