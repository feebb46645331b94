"""One streaming client for SGLang's native HTTP API (`POST /generate`, `"stream": true`), in two
forms that read and time a response the same way.

SGLang writes server-sent events: `data: {...}` lines, `data: [DONE]` last. The time to the first
token is the time to the first `data:` event; the end is the time the response has been read; the
figures are the last event's (or a non-streamed answer's) `meta_info`. Everything is timed on the
caller's `time.perf_counter` clock.

- `stream_generate`: blocking, standard library only, one request (the kv_tiers replays).
- `astream`: asyncio, on a caller's `aiohttp.ClientSession` (many requests in flight: the router
  benchmarks); it reads the body in the pieces the transport delivers and decodes only the last
  event, so the client stays cheap at a thousand requests per second. aiohttp is imported by the
  caller (the `router` extra), not here.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

DONE = b"data: [DONE]"
_TAIL_BYTES = 65536  # the end of a stream kept to decode its last event


def data_payload(line: bytes | str) -> str | None:
    """The JSON text of one `data: {...}` event line; None for other lines and for `[DONE]`."""
    text = (line.decode(errors="replace") if isinstance(line, bytes) else line).strip()
    if not text.startswith("data:") or text == "data: [DONE]":
        return None
    return text[5:].strip()


def stream_generate(base_url: str, input_ids: list[int], max_new_tokens: int, timeout_s: float = 600.0,
                    **sampling: Any) -> tuple[float, float, dict[str, Any]]:
    """Send one streaming request; (seconds to the first streamed chunk, seconds to the end, the last
    chunk's `meta_info`). Greedy unless `sampling` says otherwise; the time to the first chunk is
    NaN when the server streamed nothing."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling}
    body = {"input_ids": input_ids, "stream": True, "sampling_params": params}
    req = urllib.request.Request(f"{base_url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            payload = data_payload(raw)
            if payload is None:
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(payload)
    return ttft if ttft is not None else float("nan"), time.perf_counter() - t0, last.get("meta_info", {})


@dataclass
class Response:
    """One request as `astream` saw it. Times are seconds from sending it."""

    status: int = 0  # HTTP status; 0 when the connection failed before one arrived
    ttft_s: float = float("nan")  # first `data:` event (a non-streamed answer: its whole body)
    e2e_s: float = float("nan")  # response read to the end (or the failure)
    last_chunk_s: float = float("nan")  # last piece of the body
    events: int = 0  # `data:` lines seen, `[DONE]` included
    done: bool = False  # the stream ended with `data: [DONE]`, or a non-streamed JSON answer was read
    meta: dict[str, Any] = field(default_factory=dict)  # the last event's (or the answer's) meta_info
    last: dict[str, Any] = field(default_factory=dict)  # the last event (or the answer) whole, e.g. its output_ids
    error: str = ""  # transport error, or the start of an `"error"` in the body
    broken: bool = False  # the connection failed or was cut (a transport error, not an HTTP answer)
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def body_error(tail: bytes, streamed: bool) -> str | None:
    """The start of an error the body carries, or None: a JSON object with a top-level "error" key,
    the whole body (a non-streamed answer) or one `data:` event of a stream (`tail`: its end). A
    generated text that is or contains "error" is not one (`{"text": "error", ...}`)."""
    if b'"error"' not in tail:
        return None
    docs = ([tail] if not streamed else [p.encode() for p in map(data_payload, tail.split(b"\n")) if p is not None])
    for doc in docs:
        try:
            obj = json.loads(doc)
        except ValueError:
            continue  # the cut first line of a tail, or a body that is not JSON
        if isinstance(obj, dict) and "error" in obj:
            return doc[:200].decode(errors="replace")
    return None


async def astream(session: Any, url: str, body: dict[str, Any], *, timeout: Any = None,
                  meta: bool = True) -> Response:
    """POST `body` to `url` (a full URL, e.g. `<base>/generate`) on an `aiohttp.ClientSession` and
    read the answer as `stream_generate` does. Transport errors (aiohttp's `ClientError`, `OSError`,
    a timeout) come back as `broken` with `error` set and `status` 0 (or the status already
    received), never raised.
    `meta=False` skips decoding the last event (load generators that only time requests); with it
    `last` holds that event whole (SGLang's streamed events carry the output so far)."""
    out = Response()
    t0 = time.perf_counter()
    tail = b""
    try:
        kwargs = {"json": body} if timeout is None else {"json": body, "timeout": timeout}
        async with session.post(url, **kwargs) as r:
            out.status = r.status
            out.headers = {k: v for k, v in r.headers.items()}
            async for chunk in r.content.iter_any():
                now = time.perf_counter() - t0
                out.last_chunk_s = now
                n = chunk.count(b"data:")
                if n and out.events == 0:
                    out.ttft_s = now
                out.events += n
                tail = (tail + chunk)[-_TAIL_BYTES:]
    except (asyncio.TimeoutError, OSError) as exc:
        out.error, out.broken = repr(exc)[:200], True
    except Exception as exc:  # aiohttp.ClientError and its kin, without importing aiohttp here
        if type(exc).__module__.split(".")[0] != "aiohttp":
            raise
        out.error, out.broken = repr(exc)[:200], True
    out.e2e_s = time.perf_counter() - t0
    if out.error:
        return out
    found = body_error(tail, streamed=out.events > 0)
    if found is not None or out.status != 200:
        i = max(0, tail.find(b'"error"'))
        out.error = f"{out.status} " + (found if found is not None else tail[i:i + 200].decode(errors="replace"))
        return out
    if not out.events:  # a non-streamed answer: its first token is its whole body
        out.ttft_s, out.done = out.e2e_s, True
        if meta:
            try:
                answer = json.loads(tail)
            except ValueError:
                answer = None
            if isinstance(answer, dict):
                out.last = answer
                out.meta = answer.get("meta_info", {}) or {}
        return out
    out.done = tail.rstrip().endswith(DONE)
    if meta:
        payloads = [p for p in map(data_payload, tail.split(b"\n")) if p is not None]
        if payloads:
            try:
                out.last = json.loads(payloads[-1])
                out.meta = out.last.get("meta_info", {}) or {}
            except (ValueError, AttributeError):
                out.last = {}
    return out
