"""End to end, hostile inputs: the poison request `{"input_ids": [99999999]}` against real SGLang
servers on the CPU platform, with and without the router and the input_guard plugin, and
`sglang.bench_serving --flush-cache` run through the router.

One stock server and one with `--enable-plugin input_guard`. Through the router the poison request
is refused (400, naming the vocabulary) and both servers stay up; sent straight to the guarded
server it gets SGLang's own 400 from the guard and the server keeps serving; sent straight to the
stock server it takes that server down (SGLang 0.5.23 does not check ids against the vocabulary),
which is what the guard and the router prevent.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import aiohttp
import pytest

from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.service.router import Router
from kllm_plugins.testing.sglang_server import SGLangServer, start_all

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.slow]
POISON = {"input_ids": [99999999], "sampling_params": {"max_new_tokens": 2}}
OK = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def stock_and_guarded(tiny_model_path: Path) -> Iterator[tuple[SGLangServer, SGLangServer]]:
    servers = [SGLangServer(tiny_model_path, max_total_tokens=2048),
               SGLangServer(tiny_model_path, plugins=["input_guard"], max_total_tokens=2048)]
    start_all(servers)
    try:
        yield servers[0], servers[1]
    finally:
        for s in servers:
            s.stop()


async def post(s: aiohttp.ClientSession, url: str, body: object) -> tuple[int, bytes]:
    async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
        return r.status, await r.read()


async def healthy(s: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=20)) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


def test_poison_request_is_refused_by_router_and_guard_and_kills_only_an_unguarded_server(
        stock_and_guarded: tuple[SGLangServer, SGLangServer], tiny_model_path: Path, tmp_path: Path) -> None:
    stock, guarded = stock_and_guarded

    async def go() -> None:
        router = Router(RouterConfig(health_interval_s=1.0, loads_interval_s=0))
        async with router.serving() as rurl, aiohttp.ClientSession() as s:
            await router.add_instance(stock.base_url)
            await router.add_instance(guarded.base_url)
            # the router learnt the vocabulary from the model folder /model_info names
            cfg = json.loads((tiny_model_path / "config.json").read_text())
            assert router.limits.vocab_size == cfg["vocab_size"]
            st, body = await post(s, rurl + "/generate", POISON)
            assert st == 400 and b"outside the model's vocabulary" in body, body
            assert await healthy(s, stock.base_url) and await healthy(s, guarded.base_url)
            st, body = await post(s, rurl + "/generate", OK)
            assert st == 200, body

            # sglang.bench_serving --flush-cache through the router (the router fans /flush_cache out)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", rurl,
                "--dataset-name", "random-ids", "--num-prompts", "4", "--random-input-len", "16",
                "--random-output-len", "4", "--random-range-ratio", "1.0", "--tokenizer", str(tiny_model_path),
                "--flush-cache", "--disable-tqdm", "--seed", "1", "--output-file", str(tmp_path / "bench.jsonl"),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            out, _ = await asyncio.wait_for(proc.communicate(), 300)
            text = out.decode(errors="replace")
            assert proc.returncode == 0, text[-3000:]
            assert "Successful requests:" in text and "Successful requests:                     4" in text, text[-2000:]

            # engine side: the guarded server refuses the poison request itself and keeps serving
            st, body = await post(s, guarded.base_url + "/generate", POISON)
            assert st == 400 and b"input_guard" in body, body
            assert await healthy(s, guarded.base_url)
            st, body = await post(s, guarded.base_url + "/generate", OK)
            assert st == 200, body

        # the stock server, sent the same request directly, goes down (what both checks prevent)
        async with aiohttp.ClientSession() as s:
            try:
                await post(s, stock.base_url + "/generate", POISON)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            end = time.monotonic() + 120
            down = False
            while time.monotonic() < end and not down:
                down = not await healthy(s, stock.base_url)
                await asyncio.sleep(1.0)
            assert down, "the stock server survived an out-of-vocabulary id: the guard may no longer be needed"
            assert await healthy(s, guarded.base_url)

    asyncio.run(asyncio.wait_for(go(), 900))
