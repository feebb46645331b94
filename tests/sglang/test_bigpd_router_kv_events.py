"""End to end: kllm-router subscribes to the KV events a real SGLang server publishes.

One tiny-model server on the CPU platform with `--kv-events-config` (ZMQ). The router finds the
publisher in `/server_info`, subscribes, tokenizes text prompts with the tokenizer the server
reports, and its block index must then say that the server holds the prefix of a prompt it has
served (and not of one it has not), which only holds if the router's token chain of the prompt
equals the chain in SGLang's BlockStored events.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Iterator

import aiohttp
import pytest

from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.request_shape import parse
from kllm_plugins.plugins.bigpd_router.service.router import Router
from kllm_plugins.testing.sglang_server import SGLangServer, free_port

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]


@pytest.fixture
def publishing_server(tiny_model_path: Path) -> Iterator[SGLangServer]:
    events = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{free_port()}", "topic": ""})
    server = SGLangServer(tiny_model_path, max_total_tokens=4096, extra_args=["--kv-events-config", events])
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_router_indexes_real_kv_events_and_matches_prompts(publishing_server: SGLangServer) -> None:
    url = publishing_server.base_url
    cfg = RouterConfig(policy="slo_affinity", health_interval_s=0.5, loads_interval_s=0)

    async def go() -> None:
        router = Router(cfg)
        async with router.serving() as rurl, aiohttp.ClientSession() as s:
            inst = await router.add_instance(url)
            assert inst.kv_events and inst.kv_events["block_size"] >= 1
            for _ in range(100):  # the tokenizer loads in a thread
                if router.kv_feed._tokenizer is not None:
                    break
                await asyncio.sleep(0.1)
            assert router.kv_feed._tokenizer is not None
            served = "You are a helpful assistant for the kllm router test. " * 8 + "Question one?"
            fresh = "Completely different words about a rainy afternoon in the harbour. " * 8
            body = {"text": served, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            # ZMQ joins asynchronously: repeat until the subscription has seen the server's events
            for _ in range(20):
                async with s.post(rurl + "/generate", json=body) as r:
                    assert r.status == 200, await r.text()
                await asyncio.sleep(0.3)
                if router.kv_index.summary().get(url, {}).get("blocks", 0) > 0:
                    break
            summary = router.kv_index.summary()[url]
            assert summary["blocks"] > 0 and summary["events"] > 0, summary

            def cached(text: str) -> float:
                ids = router.kv_feed.token_ids(parse("generate", json.dumps({"text": text}).encode()))
                assert ids is not None
                return router.kv_index.match(ids, [url])[url]

            assert cached(served) > 0.9  # the served prompt's blocks are all on the server
            assert cached(served[:200] + " and then something else entirely") > 0.2  # a shared prefix
            assert cached(fresh) == 0.0
            async with s.post(rurl + "/generate", json=body) as r:  # now the index is live: it is consulted
                assert r.status == 200
            async with s.get(rurl + "/metrics") as r:
                text = await r.text()
            lookups = [ln for ln in text.splitlines() if ln.startswith("kllm_bigpd_router_kv_lookups_total")]
            assert lookups and float(lookups[0].split()[-1]) >= 1  # prefill choices used the index

    asyncio.run(asyncio.wait_for(go(), 120))
