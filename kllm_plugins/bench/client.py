"""One streaming client for SGLang's native HTTP API (`POST /generate` with `"stream": true`).

SGLang-free (standard library only): it reads the server-sent events SGLang writes (`data: {...}`
lines, `data: [DONE]` last) and times the first token and the whole request on the caller's
clock. Benchmarks use it instead of writing their own.
"""
from __future__ import annotations

import json
import time
import urllib.request
from typing import Any


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
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(line[5:])
    return ttft if ttft is not None else float("nan"), time.perf_counter() - t0, last.get("meta_info", {})
