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
