"""Unit tests (no SGLang): the router service against in-process fake SGLang backends."""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Role
from kllm_plugins.plugins.bigpd_router.service.fake_backend import FakeBackend
from kllm_plugins.plugins.bigpd_router.service.router import Router

sys.path.insert(0, str(Path(__file__).parent))
from bigpd_router_fixtures import serve  # noqa: E402

FAST = dict(health_interval_s=0.1, loads_interval_s=0.1, health_failures=1)


@contextlib.asynccontextmanager
async def cluster(backends: list[FakeBackend], cfg: RouterConfig,
                  roles: list[str | None] | None = None) -> AsyncIterator[tuple[Router, str, list[str]]]:
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve(b.app())) for b in backends]
        router = Router(cfg)
        rurl = await stack.enter_async_context(router.serving())
        for url, role in zip(urls, roles or [None] * len(urls)):
            await router.add_instance(url, Role(role) if role else None)
        yield router, rurl, urls


def run(coro_fn: Callable[[], Awaitable[None]], timeout_s: float = 60.0) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), timeout_s))


async def post(session: aiohttp.ClientSession, url: str, body: Any,
               headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, await r.read(), r.headers


def gen(text: str, n: int = 4, stream: bool = False) -> dict[str, Any]:
    return {"text": text, "stream": stream, "sampling_params": {"max_new_tokens": n}}


def test_plain_mode_non_stream_and_stream_all_endpoints() -> None:
    async def go() -> None:
        fb = FakeBackend()
        async with cluster([fb], RouterConfig(**FAST)) as (router, rurl, urls), aiohttp.ClientSession() as s:
            st, body, hdr = await post(s, rurl + "/generate", gen("hello", 3), headers={"X-Request-Id": "abc"})
            assert st == 200 and json.loads(body)["meta_info"]["completion_tokens"] == 3
            st, body, hdr = await post(s, rurl + "/generate", gen("hello", 3))
            assert hdr["X-Request-Id"] and fb.requests[-1]["rid"] == hdr["X-Request-Id"]
            st, body, _ = await post(s, rurl + "/v1/chat/completions",
                                     {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                      "stream": True})
            events = [ln for ln in body.split(b"\n") if ln.startswith(b"data:")]
            assert st == 200 and len(events) == 6 and events[-1] == b"data: [DONE]"
            st, body, _ = await post(s, rurl + "/v1/completions", {"prompt": "abc", "max_tokens": 2})
            assert st == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
            async with s.get(rurl + "/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"][0]["id"] == "fake"
            async with s.get(rurl + "/metrics") as r:
                text = await r.text()
            assert 'kllm_bigpd_router_requests_total{endpoint="generate",status="200"}' in text
            assert "kllm_bigpd_router_slo_load_ratio" in text
            inst = router.registry.get(urls[0])
            assert inst is not None and inst.in_flight == 0 and inst.pending_prefill_tokens == 0
            assert inst.decoding == 0
    run(go)


def test_malformed_and_oversized_requests_get_clear_4xx() -> None:
    async def go() -> None:
        fb = FakeBackend()
        cfg = RouterConfig(max_body_bytes=4096, **FAST)
        async with cluster([fb], cfg) as (_, rurl, _urls), aiohttp.ClientSession() as s:
            cases = [
                ("/generate", b"{not json", 400, "not valid JSON"),
                ("/generate", b"[1, 2]", 400, "JSON object"),
                ("/generate", {"sampling_params": {}}, 400, "'text'"),
                ("/generate", {"text": "x", "stream": "yes"}, 400, "'stream'"),
                ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
                ("/v1/chat/completions", {"messages": []}, 400, "messages"),
                ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "role"),
                ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
                ("/generate", {"text": "x" * 10000}, 413, "larger than"),
            ]
            for path, body, status, needle in cases:
                st, data, hdr = await post(s, rurl + path, body)
                assert st == status, (path, body, data)
                err = json.loads(data)["error"]
                assert needle in err["message"] and err["code"] == status and hdr["X-Request-Id"]
            assert fb.requests == []  # nothing malformed reached the instance
    run(go)


def test_retry_on_another_instance_before_first_token() -> None:
    async def go() -> None:
        bad, good = FakeBackend(status_override=500), FakeBackend()
        cfg = RouterConfig(policy="round_robin", max_retries=1, **FAST)
        async with cluster([bad, good], cfg) as (router, rurl, urls), aiohttp.ClientSession() as s:
            for i in range(4):
                st, body, _ = await post(s, rurl + "/generate", gen(f"p{i}", 2, stream=bool(i % 2)))
                assert st == 200, body
            assert len(good.requests) == 4 and len(bad.requests) >= 1
            assert router.registry.get(urls[0]).health is Health.UNHEALTHY  # type: ignore[union-attr]
    run(go)


def test_all_instances_failing_gives_502_not_a_hang() -> None:
    async def go() -> None:
        a, b = FakeBackend(status_override=503), FakeBackend(status_override=500)
        cfg = RouterConfig(max_retries=3, health_interval_s=60, loads_interval_s=0, health_failures=1)
        async with cluster([a, b], cfg) as (router, rurl, _urls), aiohttp.ClientSession() as s:
            st, body, _ = await post(s, rurl + "/generate", gen("x"))
            assert st == 502 and "before the first token" in json.loads(body)["error"]["message"]
            for inst in router.registry:
                assert inst.health is Health.UNHEALTHY
            # both unhealthy: panic mode still tries them (a false "down" must not refuse traffic)
            st, body, _ = await post(s, rurl + "/generate", gen("x"))
            assert st == 502
            a.status_override = 0
            st, body, _ = await post(s, rurl + "/generate", gen("x"))
            assert st == 200
    run(go)


def test_slow_instance_times_out_and_request_moves_on() -> None:
    async def go() -> None:
        slow, fast = FakeBackend(ttft_s=5.0), FakeBackend()
        cfg = RouterConfig(policy="round_robin", first_token_timeout_s=0.3, max_retries=1, health_interval_s=5,
                           loads_interval_s=0)
        async with cluster([slow, fast], cfg) as (router, rurl, urls), aiohttp.ClientSession() as s:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            results = await asyncio.gather(*(post(s, rurl + "/generate", gen(f"q{i}", 2, stream=True))
                                             for i in range(4)))
            assert all(st == 200 for st, _, _ in results)
            assert loop.time() - t0 < 3.0
            assert len(fast.requests) == 4
    run(go)


def test_instance_dying_mid_stream_ends_stream_with_explicit_error() -> None:
    async def go() -> None:
        fb = FakeBackend(fail_after_events=2, tpot_s=0.05)
        async with cluster([fb], RouterConfig(**FAST)) as (router, rurl, urls), aiohttp.ClientSession() as s:
            st, body, _ = await post(s, rurl + "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 6, "stream": True})
            events = [ln for ln in body.split(b"\n") if ln.startswith(b"data:")]
            assert st == 200 and len(events) == 4
            assert b'"upstream_error"' in events[-2] and events[-1] == b"data: [DONE]"
            inst = router.registry.get(urls[0])
            assert inst is not None and inst.in_flight == 0 and inst.decoding == 0
    run(go)


def test_prefix_affinity_sends_shared_prefixes_to_the_same_instance() -> None:
    async def go() -> None:
        backends = [FakeBackend(), FakeBackend(), FakeBackend()]
        # a loose TTFT target: millisecond timing noise between idle fake backends is a tie
        cfg = RouterConfig(policy="slo_affinity", ttft_target_s=100.0, **FAST)
        async with cluster(backends, cfg) as (router, rurl, urls), aiohttp.ClientSession() as s:
            prefixes = [f"system prompt number {k} " * 20 for k in range(3)]
            for rep in range(3):
                for k, pre in enumerate(prefixes):
                    st, _, _ = await post(s, rurl + "/generate", gen(pre + f"question {rep}", 1))
                    assert st == 200
            for b in backends:
                seen = {r["body"]["text"][:30] for r in b.requests}
                assert len(seen) <= 1  # each backend got one prefix family only
            assert sum(1 for b in backends if b.requests) == 3  # and they were spread
    run(go)


def test_pd_mode_sends_paired_requests_with_bootstrap_fields() -> None:
    async def go() -> None:
        p1, p2 = FakeBackend(role="prefill", bootstrap_port=9101), FakeBackend(role="prefill", bootstrap_port=9102)
        d1 = FakeBackend(role="decode")
        async with cluster([p1, p2, d1], RouterConfig(**FAST)) as (router, rurl, urls), aiohttp.ClientSession() as s:
            assert router.pd_mode()
            for i in range(4):
                st, body, _ = await post(s, rurl + "/generate", gen(f"pd {i} " * 30, 3, stream=i % 2 == 0))
                assert st == 200
            assert len(d1.requests) == 4 and len(p1.requests) + len(p2.requests) == 4
            for dreq in d1.requests:
                room = dreq["body"]["bootstrap_room"]
                [preq] = [r for r in p1.requests + p2.requests if r["body"]["bootstrap_room"] == room]
                assert preq["body"]["stream"] is False
                owner = p1 if preq in p1.requests else p2
                assert dreq["body"]["bootstrap_port"] == owner.bootstrap_port
                assert dreq["body"]["bootstrap_host"] == "127.0.0.1"
            for u in urls:
                inst = router.registry.get(u)
                assert inst is not None and inst.in_flight == 0 and inst.pending_prefill_tokens == 0
    run(go)


def test_pd_prefill_failure_is_retried_with_another_prefill() -> None:
    async def go() -> None:
        pbad = FakeBackend(role="prefill", status_override=500)
        pgood = FakeBackend(role="prefill", bootstrap_port=9200)
        d1 = FakeBackend(role="decode", ttft_s=0.3)  # decode waits for the KV, so prefill fails first
        cfg = RouterConfig(policy="round_robin", max_retries=1, **FAST)
        async with cluster([pbad, pgood, d1], cfg) as (router, rurl, urls), aiohttp.ClientSession() as s:
            for i in range(2):
                st, body, _ = await post(s, rurl + "/generate", gen(f"x{i}", 2, stream=True))
                assert st == 200, body
            rooms_ok = {r["body"]["bootstrap_room"] for r in pgood.requests}
            rooms_bad = {r["body"]["bootstrap_room"] for r in pbad.requests}
            assert len(rooms_ok) == 2 and rooms_bad and not rooms_ok & rooms_bad
            # each served request was a pair (good prefill, decode); the failed pairs were abandoned
            assert rooms_ok <= {r["body"]["bootstrap_room"] for r in d1.requests}
    run(go)


def test_admin_api_add_remove_with_drain() -> None:
    async def go() -> None:
        a, b = FakeBackend(), FakeBackend(tpot_s=0.05)
        async with contextlib.AsyncExitStack() as stack:
            ua = await stack.enter_async_context(serve(a.app()))
            ub = await stack.enter_async_context(serve(b.app()))
            router = Router(RouterConfig(**FAST))
            rurl = await stack.enter_async_context(router.serving())
            s = await stack.enter_async_context(aiohttp.ClientSession())
            st, body, _ = await post(s, rurl + "/admin/instances", {"url": ua})
            assert st == 201 and json.loads(body)["role"] == "plain"
            st, _, _ = await post(s, rurl + "/admin/instances", {"url": ua})
            assert st == 409
            st, _, _ = await post(s, rurl + "/admin/instances", {"nope": 1})
            assert st == 400
            st, _, _ = await post(s, rurl + "/admin/instances", {"url": "http://127.0.0.1:9"})
            assert st == 502  # not answering and no role given
            st, _, _ = await post(s, rurl + "/admin/instances", {"url": ub, "role": "plain"})
            assert st == 201
            # a long stream on b, then remove b: it drains, finishes the stream, then leaves
            router.picker.policy = "round_robin"
            streams = [asyncio.create_task(post(s, rurl + "/generate", gen(f"s{i}", 20, stream=True)))
                       for i in range(2)]
            await asyncio.sleep(0.2)
            async with s.delete(rurl + "/admin/instances", params={"url": ub}) as r:
                assert r.status == 202
            assert ub in router.registry
            async with s.get(rurl + "/admin/instances") as r:
                states = {i["url"]: i["health"] for i in (await r.json())["instances"]}
            assert states[ub] == "draining"
            for t in streams:
                st, body, _ = await t
                assert st == 200 and body.count(b"data:") == 21
            await asyncio.sleep(0.5)
            assert ub not in router.registry and ua in router.registry
            async with s.delete(rurl + "/admin/instances", params={"url": ub}) as r:
                assert r.status == 404
    run(go)


def test_health_checks_mark_down_and_back_up() -> None:
    async def go() -> None:
        a = FakeBackend()
        async with cluster([a], RouterConfig(**FAST)) as (router, rurl, urls), aiohttp.ClientSession() as s:
            a.healthy = False
            await asyncio.sleep(0.4)
            assert router.registry.get(urls[0]).health is Health.UNHEALTHY  # type: ignore[union-attr]
            async with s.get(rurl + "/health") as r:
                assert r.status == 503
            a.healthy = True
            await asyncio.sleep(0.4)
            async with s.get(rurl + "/health") as r:
                assert r.status == 200
    run(go)


def test_health_generate_asks_the_instances_own_probe() -> None:
    async def go() -> None:
        a, b = FakeBackend(), FakeBackend()
        async with cluster([a, b], RouterConfig(**FAST)) as (router, rurl, urls), aiohttp.ClientSession() as s:
            b.healthy = False
            async with s.get(rurl + "/health_generate") as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
            a.healthy = False
            async with s.get(rurl + "/health_generate") as r:
                assert r.status == 503 and (await r.json())["failing_roles"] == ["plain"]
            a.healthy = True  # back once the health loop has it routable again
            status = 0
            for _ in range(200):
                async with s.get(rurl + "/health_generate") as r:
                    status = r.status
                if status == 200:
                    break
                await asyncio.sleep(0.05)
            assert status == 200
    run(go)


def test_slo_load_reflects_measured_ttft() -> None:
    async def go() -> None:
        a = FakeBackend(ttft_s=0.2, tpot_s=0.01)
        cfg = RouterConfig(ttft_target_s=0.1, tpot_target_s=0.5, **FAST)
        async with cluster([a], cfg) as (router, rurl, urls), aiohttp.ClientSession() as s:
            for i in range(3):
                await post(s, rurl + "/generate", gen(f"x{i}", 5, stream=True))
            load = router.pool_load(Role.PLAIN)
            assert load.actual == pytest.approx(0.2, rel=0.5) and load.load > 1.0
            async with s.get(rurl + "/admin/loads") as r:
                assert (await r.json())["pools"]["plain"]["load"] > 1.0
    run(go)


def test_cli_options_environment_yaml_and_instances_file(tmp_path: Any) -> None:
    from kllm_plugins.plugins.bigpd_router.service.cli import build_parser, config_from, instances_from

    cfg_file = tmp_path / "kllm.yaml"
    cfg_file.write_text("bigpd_router:\n  ttft_target_s: 0.7\n  max_retries: 3\n")
    inst_file = tmp_path / "instances.yaml"
    inst_file.write_text("- {url: 'http://p:1', role: prefill, bootstrap_port: 9000}\n- http://w:2\n")
    args = build_parser().parse_args(["--config", str(cfg_file), "--instances-file", str(inst_file),
                                      "--worker", "http://a:1", "--decode", "http://d:1", "--max-retries", "2"])
    cfg = config_from(args, environ={"KLLM_BIGPD_ROUTER_TPOT_TARGET_S": "0.03"})
    assert (cfg.ttft_target_s, cfg.tpot_target_s, cfg.max_retries) == (0.7, 0.03, 2)  # CLI > env > YAML
    assert instances_from(args) == [
        {"url": "http://a:1", "role": "plain"}, {"url": "http://d:1", "role": "decode"},
        {"url": "http://p:1", "role": "prefill", "bootstrap_port": 9000}, {"url": "http://w:2"}]
    with pytest.raises(Exception, match="policy"):
        config_from(build_parser().parse_args(["--policy", "nope"]), environ={})
