"""Unit tests (no SGLang): a new instance (a promoted standby) gets traffic.

The router learns each instance's prefill rate only from the requests that instance serves. A
promoted standby whose first request was slow (a cold cache, a loaded host) must not be priced
out for good by that one measurement, and a non-streamed answer must not teach the router a
TTFT or TPOT it cannot see. CI once saw the first case: the promoted standby served one request
and then none in 600 s while its peer took every request.
"""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.pairing import MIN_RATE_SAMPLES, Picker
from kllm_plugins.plugins.bigpd_router.core.prefix_tree import PrefixTree
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Instance, Role
from kllm_plugins.plugins.bigpd_router.core.slo_load import measured_tpot, observe_tpot
from kllm_plugins.plugins.bigpd_router.service.fake_backend import FakeBackend
from kllm_plugins.plugins.bigpd_router.service.router import Router

sys.path.insert(0, str(Path(__file__).parent))
from bigpd_router_fixtures import serve  # noqa: E402


def healthy(url: str) -> Instance:
    return Instance(url=url, role=Role.PLAIN, health=Health.HEALTHY)


def test_one_slow_first_measurement_does_not_starve_a_new_instance() -> None:
    picker = Picker("slo_affinity", PrefixTree(block=64), ttft_target_s=1.0, tpot_target_s=0.1)
    a, b = healthy("http://a"), healthy("http://b")
    for _ in range(20):
        a.prefill_rate.update(283.0)
    b.prefill_rate.update(2.7)  # the figures CI's loaded machine produced: B's first request took ~2 s
    # A busy with the other client's request, B idle: B is taken although its one sample is slow
    a.in_flight, a.pending_prefill_tokens = 1, 6
    assert picker.pick_prefill([a, b], "request 7 says", 6).instance is b
    # both idle: a tie, taken in turn
    a.in_flight = a.pending_prefill_tokens = 0
    assert {picker.pick_prefill([a, b], "request 8 says", 6).instance.url for _ in range(4)} == {a.url, b.url}
    # measured MIN_RATE_SAMPLES times, B is judged on its own rate: really slow, it is not taken
    for _ in range(MIN_RATE_SAMPLES - 1):
        b.prefill_rate.update(2.7)
    a.in_flight, a.pending_prefill_tokens = 1, 6
    assert picker.pick_prefill([a, b], "request 9 says", 6).instance is a
    # a new instance faster than its peers keeps its own (better) rate
    c = healthy("http://c")
    c.prefill_rate.update(5000.0)
    assert picker._rates([a, c])[c.url] == 5000.0


def test_tpot_reference_is_a_measurement_or_none() -> None:
    a, b = healthy("http://a"), healthy("http://b")
    assert measured_tpot(b, [a, b]) is None  # the prior is not a measurement
    observe_tpot(a, 0.01, batch=0)
    assert measured_tpot(b, [a, b]) == pytest.approx(0.01)  # borrowed from the measured peer
    observe_tpot(b, 0.03, batch=0)
    assert measured_tpot(b, [a, b]) == pytest.approx(0.03)  # its own once it has one


def test_non_streamed_answers_teach_no_tpot_and_a_rate_only_from_a_measured_tpot() -> None:
    async def go() -> None:
        fb = FakeBackend(ttft_s=0.05, tpot_s=0.02)
        async with serve(fb.app()) as url:
            router = Router(RouterConfig(health_interval_s=60, loads_interval_s=0))
            async with router.serving() as rurl, aiohttp.ClientSession() as s:
                inst = await router.add_instance(url, Role.PLAIN)

                async def generate(stream: bool) -> None:
                    body: dict[str, Any] = {"text": "hello there", "stream": stream,
                                            "sampling_params": {"max_new_tokens": 5}}
                    async with s.post(rurl + "/generate", data=json.dumps(body).encode()) as r:
                        assert r.status == 200
                        await r.read()

                for _ in range(3):
                    await generate(stream=False)
                # no stream seen: the TTFT of a whole answer is a guess, nothing is learnt from it
                assert inst.tpot.samples == 0 and inst.prefill_rate.samples == 0
                assert inst.in_flight == 0 and inst.pending_prefill_tokens == 0 and inst.decoding == 0
                await generate(stream=True)
                assert inst.tpot.samples == 1 and inst.prefill_rate.samples == 1
                await generate(stream=False)
                # with a measured TPOT the whole answer's TTFT is inferred and learnt; the TPOT is not
                assert inst.tpot.samples == 1 and inst.prefill_rate.samples == 2
                assert inst.in_flight == 0 and inst.pending_prefill_tokens == 0 and inst.decoding == 0

    asyncio.run(asyncio.wait_for(go(), 60))
