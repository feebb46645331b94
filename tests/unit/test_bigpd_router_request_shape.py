"""The router reads chat bodies it does not understand without failing: a content part whose
`text` is not a string (schemathesis found `{"type": "reasoning", "text": null}` answered with
HTTP 500 by kllm-router and with 400 by SGLang) goes to the instance, which judges it."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp

from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.request_shape import parse
from kllm_plugins.plugins.bigpd_router.service.fake_backend import FakeBackend
from kllm_plugins.plugins.bigpd_router.service.router import Router

sys.path.insert(0, str(Path(__file__).parent))
from bigpd_router_fixtures import serve  # noqa: E402

# the generated body verbatim (tests/conformance/test_schemathesis.py, router against a real server)
FOUND = Path(__file__).parents[1] / "conformance" / "data" / "router_chat_500_body.json"


def test_non_string_text_parts_are_left_out_of_the_affinity_prompt() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": None}, {"type": "text", "text": "hi"},
                                                      {"type": "text", "text": 3}, {"type": "image_url"}]},
                         {"role": "assistant", "content": [{"type": "reasoning", "text": None, "thinking": None}]}]}
    shape = parse("chat", json.dumps(body).encode())
    assert shape.prompt == "user:hi\nassistant:"


def test_found_chat_body_is_passed_to_the_instance_not_answered_500() -> None:
    raw = FOUND.read_bytes()
    assert b'"text": null, "type": "reasoning"' in raw
    assert parse("chat", raw).prompt.startswith("user:")

    async def go() -> None:
        fb = FakeBackend()
        router = Router(RouterConfig(health_interval_s=0.1, loads_interval_s=0.1, health_failures=1))
        async with serve(fb.app()) as url, router.serving() as rurl, aiohttp.ClientSession() as s:
            await router.add_instance(url, None)
            async with s.post(rurl + "/v1/chat/completions", data=raw,
                              headers={"Content-Type": "application/json"}) as r:
                status, text = r.status, await r.text()
        assert status == 200, (status, text)  # what the instance answered (the fake one accepts it)
        assert len(fb.requests) == 1

    asyncio.run(asyncio.wait_for(go(), 60))
