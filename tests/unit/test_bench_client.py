"""The harness's streaming client against a local HTTP server that streams as SGLang does."""
from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest

from kllm_plugins.bench.client import stream_generate


@pytest.fixture
def sse_server() -> Iterator[tuple[str, list[dict[str, Any]], list[bytes]]]:
    """A server answering POST /generate with the chunks in `chunks` (the list the test fills),
    recording each request body it got."""
    bodies: list[dict[str, Any]] = []
    chunks: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for c in chunks:
                self.wfile.write(c)
                self.wfile.flush()

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", bodies, chunks
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_streams_a_greedy_request_and_returns_the_last_meta(sse_server) -> None:  # type: ignore[no-untyped-def]
    url, bodies, chunks = sse_server
    chunks += [b'data: {"text": "a", "meta_info": {"completion_tokens": 1}}\n\n',
               b'data: {"text": "ab", "meta_info": {"completion_tokens": 2, "cached_tokens": 16}}\n\n',
               b"data: [DONE]\n\n"]
    ttft, e2e, meta = stream_generate(url, [1, 2, 3], 2)
    assert meta == {"completion_tokens": 2, "cached_tokens": 16}
    assert 0 <= ttft <= e2e
    assert bodies == [{"input_ids": [1, 2, 3], "stream": True,
                       "sampling_params": {"max_new_tokens": 2, "temperature": 0}}]
    stream_generate(url, [4], 1, temperature=0.7, top_p=0.9)
    assert bodies[-1]["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.7, "top_p": 0.9}


def test_a_stream_without_chunks_has_no_first_token_time(sse_server) -> None:  # type: ignore[no-untyped-def]
    url, _, chunks = sse_server
    chunks.append(b"data: [DONE]\n\n")
    ttft, e2e, meta = stream_generate(url, [1], 1)
    assert math.isnan(ttft) and e2e >= 0 and meta == {}


def _astream(url: str, body: dict[str, Any], **kw: Any) -> Any:
    aiohttp = pytest.importorskip("aiohttp")
    from kllm_plugins.bench.client import astream

    async def go() -> Any:
        async with aiohttp.ClientSession() as s:
            return await astream(s, url + "/generate", body, **kw)

    import asyncio
    return asyncio.run(go())


def test_astream_reads_a_stream_as_stream_generate_does(sse_server) -> None:  # type: ignore[no-untyped-def]
    url, bodies, chunks = sse_server
    chunks += [b'data: {"text": "a", "meta_info": {"completion_tokens": 1}}\n\n',
               b'data: {"text": "ab", "meta_info": {"completion_tokens": 2, "cached_tokens": 16}}\n\n',
               b"data: [DONE]\n\n"]
    r = _astream(url, {"text": "hi", "stream": True})
    assert bodies == [{"text": "hi", "stream": True}]
    assert r.ok and r.done and r.status == 200 and r.events == 3
    assert r.meta == {"completion_tokens": 2, "cached_tokens": 16}
    assert r.last["text"] == "ab"  # the last event whole (SGLang's carry the output so far)
    assert 0 <= r.ttft_s <= r.last_chunk_s <= r.e2e_s
    assert r.headers["Content-Type"] == "text/event-stream"
    assert _astream(url, {"text": "hi", "stream": True}, meta=False).meta == {}


def test_astream_reports_a_stream_cut_short_and_an_error_event(sse_server) -> None:  # type: ignore[no-untyped-def]
    url, _, chunks = sse_server
    chunks += [b'data: {"text": "a", "meta_info": {}}\n\n']
    r = _astream(url, {"text": "x", "stream": True})
    assert r.ok and not r.done  # no [DONE]: the stream ended early
    chunks += [b'data: {"error": {"message": "stalled"}}\n\n', b"data: [DONE]\n\n"]
    r = _astream(url, {"text": "x", "stream": True})
    assert not r.ok and not r.broken and '"error"' in r.error and "stalled" in r.error


def test_astream_times_a_plain_answer_and_returns_its_meta(sse_server) -> None:  # type: ignore[no-untyped-def]
    url, _, chunks = sse_server
    chunks.append(b'{"text": "ab", "meta_info": {"prompt_tokens": 3}}')
    r = _astream(url, {"text": "x"})
    assert r.ok and r.done and r.events == 0 and r.meta == {"prompt_tokens": 3}
    assert r.ttft_s == r.e2e_s


def test_astream_returns_a_refused_connection_as_an_error() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = _astream(f"http://127.0.0.1:{port}", {"text": "x"})
    assert not r.ok and r.broken and r.status == 0 and r.error and r.e2e_s >= 0


def test_astream_does_not_take_a_generated_error_word_for_an_error(sse_server) -> None:  # type: ignore[no-untyped-def]
    """A request whose output decodes to "error" (a real grid run's lognormal seed 0, token 1277 of
    the tiny model) was counted as failed: the body held `"text":"error"`."""
    url, _, chunks = sse_server
    chunks += [b'data: {"text":"error","output_ids":[1277],"meta_info":{"finish_reason":null}}\n\n',
               b'data: {"text":"error \\"error\\"","output_ids":[1277,5],"meta_info":{}}\n\n', b"data: [DONE]\n\n"]
    r = _astream(url, {"text": "x", "stream": True})
    assert r.ok and r.done and r.last["output_ids"] == [1277, 5]


def test_body_error_finds_only_a_top_level_error_key() -> None:
    from kllm_plugins.bench.client import body_error

    assert body_error(b'{"error": {"message": "bad"}}', streamed=False) == '{"error": {"message": "bad"}}'
    assert body_error(b'{"text": "error"}', streamed=False) is None
    assert body_error(b'data: {"text": "error"}\n\ndata: {"error": "x"}\n\ndata: [DONE]\n\n', streamed=True) == '{"error": "x"}'
    assert body_error(b'"error"}\n\ndata: {"text": "ok"}\n\n', streamed=True) is None  # a tail's cut first line
    assert body_error(b"no error key here", streamed=False) is None
