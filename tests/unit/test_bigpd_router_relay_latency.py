"""The relay-latency benchmark's measurement: the fake backend stamps each stream event as it
writes it, and the benchmark's client reads one delay per token, directly and through kllm-router
(the router passes the stamps through untouched)."""
from __future__ import annotations

from types import ModuleType
from typing import Callable

from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.service.fake_backend import FakeBackend

from test_bigpd_router_service import cluster, run  # type: ignore[import-not-found]


def test_every_token_is_timed_direct_and_through_the_router(bench_module: Callable[[str, str], ModuleType]) -> None:
    bench = bench_module("bigpd_router", "bench_relay_latency")

    async def go() -> None:
        stamped, plain = FakeBackend(stamp=True, tpot_s=0.005), FakeBackend(tpot_s=0.005)
        async with cluster([stamped], RouterConfig(loads_interval_s=0)) as (_router, rurl, urls):
            for url in (urls[0], rurl):
                host, port = url.split("//")[1].split(":")
                delays: list[float] = []
                gaps: list[float] = []
                assert await bench._stream(host, int(port), 12, delays, gaps) == 12
                assert len(delays) == 12 and all(0 <= d < 1e6 for d in delays)  # microseconds, under 1 s
                # one added gap per stream: the delay's change first -> last token over 11 gaps
                assert gaps == [(delays[-1] - delays[0]) / 11]
        async with cluster([plain], RouterConfig(loads_interval_s=0)) as (_router, rurl, _urls):
            host, port = rurl.split("//")[1].split(":")
            none: list[float] = []
            no_gaps: list[float] = []
            assert await bench._stream(host, int(port), 5, none, no_gaps) == 0 and none == [] and no_gaps == []  # no stamps: nothing timed

    run(go)
