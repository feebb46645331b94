"""The router under hostile conditions (no SGLang): poison requests, stalled and stopped instances,
slow clients, clients that leave or reset, and the routes clients and sglang.bench_serving use."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import sys
from pathlib import Path

import aiohttp
import pytest

from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.input_limits import token_id_problem
from kllm_plugins.plugins.bigpd_router.core.poison import PoisonLedger
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Role
from kllm_plugins.plugins.bigpd_router.service.fake_backend import FakeBackend

sys.path.insert(0, str(Path(__file__).parent))
from test_bigpd_router_service import cluster, gen, post, run  # noqa: E402

QUIET = dict(health_interval_s=0.2, loads_interval_s=0, health_failures=1)


def counter(router: object, name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


async def wait_for(cond: object, timeout_s: float, step_s: float = 0.02) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while loop.time() < end:
        if cond():  # type: ignore[operator]
            return True
        await asyncio.sleep(step_s)
    return bool(cond())  # type: ignore[operator]


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# ---------------------------------------------------------------- core
def test_token_id_problem_names_the_bad_id_and_the_range() -> None:
    assert token_id_problem([1, 2, 3], 100, 10) is None
    assert "99999999" in (token_id_problem([1, 99999999], 100, None) or "")
    assert "[0, 100)" in (token_id_problem([-1], 100, None) or "")
    assert "context" in (token_id_problem(list(range(10)), 100, 10) or "")
    assert token_id_problem([99999999], None, None) is None  # nothing known: nothing refused


def test_poison_ledger_quarantines_after_two_instances_and_forgets_later() -> None:
    led = PoisonLedger(quarantine_s=10.0)
    assert not led
    assert led.crashed(b"f", "a", now=0.0) == 1 and not led.quarantined(b"f", now=0.0)
    assert led.crashed(b"f", "a", now=1.0) == 1  # the same instance twice is one instance
    assert led.crashed(b"f", "b", now=2.0) == 2 and led.quarantined(b"f", now=3.0)
    assert not led.quarantined(b"f", now=12.5) and led.crash_count(b"f") == 0


# ---------------------------------------------------------------- poison requests
def test_out_of_vocabulary_token_id_is_refused_and_no_instance_is_touched(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))

    async def go() -> None:
        backends = [FakeBackend(crash_on="99999999", model_path=str(tmp_path), context_len=64) for _ in range(2)]
        async with cluster(backends, RouterConfig(**QUIET)) as (router, rurl, urls), aiohttp.ClientSession() as s:
            st, body, _ = await post(s, rurl + "/generate", {"input_ids": [99999999]})
            assert st == 400, body
            assert (router.limits.vocab_size, router.limits.context_len) == (1000, 64)
            assert "token id 99999999 is outside the model's vocabulary [0, 1000)" in json.loads(body)["error"]["message"]
            st, body, _ = await post(s, rurl + "/v1/completions", {"prompt": list(range(70)), "max_tokens": 1})
            assert st == 400 and "context is 64 tokens" in json.loads(body)["error"]["message"]
            assert all(not b.dead and not b.requests for b in backends)
            st, _, _ = await post(s, rurl + "/generate", {"input_ids": [1, 2, 999]})
            assert st == 200
            async with s.get(rurl + "/health") as r:
                assert r.status == 200
    run(go)


def test_request_that_drops_two_instances_is_not_retried_again_and_is_quarantined() -> None:
    async def go() -> None:
        backends = [FakeBackend(crash_on="POISON") for _ in range(3)]
        cfg = RouterConfig(policy="round_robin", max_retries=3, **QUIET)
        async with cluster(backends, cfg) as (router, rurl, urls), aiohttp.ClientSession() as s:
            st, body, _ = await post(s, rurl + "/generate", gen("POISON pill"))
            err = json.loads(body)["error"]
            assert st == 502 and err["type"] == "poison_request", body
            assert "dropped it with no answer" in err["message"]
            assert sum(b.dead for b in backends) == 2  # retried once after the first crash, never after the second
            survivor = next(b for b in backends if not b.dead)
            st, body, _ = await post(s, rurl + "/generate", gen("POISON pill"))
            assert st == 422 and json.loads(body)["error"]["type"] == "poison_request"
            assert not survivor.dead and not any(r["body"].get("text") == "POISON pill" for r in survivor.requests)
            st, _, _ = await post(s, rurl + "/generate", gen("harmless"))
            assert st == 200
            async with s.get(rurl + "/health") as r:
                assert r.status == 200
    run(go)


def test_instance_dying_under_a_request_gets_one_retry_that_succeeds() -> None:
    async def go() -> None:
        a, b = FakeBackend(crash_on="BOOM"), FakeBackend()
        cfg = RouterConfig(policy="round_robin", max_retries=1, **QUIET)
        async with cluster([a, b], cfg) as (router, rurl, urls), aiohttp.ClientSession() as s:
            for i in range(2):  # round robin: one of them is sent to `a` first
                st, body, _ = await post(s, rurl + "/generate", gen(f"BOOM {i}", 2, stream=True))
                assert st == 200 and body.count(b"data:") == 3
            assert a.dead and len(b.requests) == 2
            assert router.registry.get(urls[0]).health is Health.UNHEALTHY  # type: ignore[union-attr]
    run(go)


# ---------------------------------------------------------------- stalled instances
def test_stream_stalled_mid_way_ends_with_an_error_event_after_the_stall_timeout() -> None:
    async def go() -> None:
        fb = FakeBackend(stall_after_events=2, tpot_s=0.01)
        cfg = RouterConfig(stall_timeout_s=0.5, **QUIET)
        async with cluster([fb], cfg) as (router, rurl, urls), aiohttp.ClientSession() as s:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            st, body, _ = await post(s, rurl + "/v1/completions", {"prompt": "p", "max_tokens": 8, "stream": True})
            took = loop.time() - t0
            events = [ln for ln in body.split(b"\n") if ln.startswith(b"data:")]
            assert st == 200 and len(events) == 4, body
            assert b"sent nothing for 0.5 s" in events[-2] and events[-1] == b"data: [DONE]"
            assert took < 10.0  # not the 300 s request timeout
            assert await wait_for(lambda: fb.running == 0, 5.0)  # aborted upstream
            assert counter(router, "kllm_bigpd_router_requests_total", endpoint="completions", status="504") >= 1
    run(go)


# ---------------------------------------------------------------- clients that leave
def _raw_request(body: dict[str, object], path: str = "/generate") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_non_streamed_request_is_aborted_upstream_when_its_client_leaves() -> None:
    async def go() -> None:
        fb = FakeBackend(tpot_s=0.5)
        async with cluster([fb], RouterConfig(**QUIET)) as (router, rurl, urls):
            before = counter(router, "kllm_bigpd_router_requests_total", endpoint="generate", status="499")
            sock = socket.create_connection(("127.0.0.1", port_of(rurl)))
            sock.sendall(_raw_request(gen("leave me", 20)))
            assert await wait_for(lambda: fb.running == 1, 5.0)
            sock.close()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            assert await wait_for(lambda: fb.running == 0, 5.0)
            assert loop.time() - t0 < 1.5  # the answer would take ~9.5 s more
            assert counter(router, "kllm_bigpd_router_requests_total", endpoint="generate",
                           status="499") == before + 1
            assert counter(router, "kllm_bigpd_router_client_disconnects_total", phase="waiting") >= 1
    run(go)


def _reset_storm(loop_factory: str) -> None:
    async def go() -> None:
        fb = FakeBackend(tpot_s=0.02)
        async with cluster([fb], RouterConfig(**QUIET)) as (router, rurl, urls):
            before = counter(router, "kllm_bigpd_router_client_disconnects_total", phase="streaming")
            socks = []
            for i in range(20):
                sk = socket.create_connection(("127.0.0.1", port_of(rurl)))
                sk.sendall(_raw_request(gen(f"r{i}", 200, stream=True)))
                socks.append(sk)
            await asyncio.sleep(0.3)
            for sk in socks:
                sk.recv(100)  # the stream has started
                _reset(sk)
            assert await wait_for(lambda: fb.running == 0, 10.0)
            assert await wait_for(lambda: counter(router, "kllm_bigpd_router_client_disconnects_total",
                                                  phase="streaming") == before + 20, 5.0)
            assert counter(router, "kllm_bigpd_router_requests_total", endpoint="generate", status="499") >= 20
            inst = router.registry.get(urls[0])
            assert inst is not None and inst.in_flight == 0
            async with aiohttp.ClientSession() as s:
                st, _, _ = await post(s, rurl + "/generate", gen("after the storm", 2))
                assert st == 200

    if loop_factory == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(asyncio.wait_for(go(), 60))
    else:
        run(go)


@pytest.mark.parametrize("loop_factory", ["asyncio", "uvloop"])
def test_clients_resetting_streams_are_counted_as_disconnects_without_errors(
        loop_factory: str, caplog: pytest.LogCaptureFixture) -> None:
    logging.getLogger("kllm").propagate = True
    with caplog.at_level(logging.INFO, logger="kllm"):
        _reset_storm(loop_factory)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith(("kllm", "asyncio"))]
    assert not errors, [r.getMessage() for r in errors]
    assert sum("status=499" in r.getMessage() for r in caplog.records) >= 20  # one log line per reset request


# ---------------------------------------------------------------- slow clients
def test_slow_clients_are_timed_out_and_one_address_cannot_hold_every_connection() -> None:
    async def go() -> None:
        cfg = RouterConfig(header_timeout_s=0.5, body_timeout_s=0.5, idle_timeout_s=0.5, max_client_connections=4,
                           **QUIET)
        async with cluster([FakeBackend()], cfg) as (router, rurl, urls):
            port = port_of(rurl)

            async def answer(payload: bytes) -> bytes:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(payload)
                data = await asyncio.wait_for(reader.read(), 10.0)  # until the router closes
                writer.close()
                return data

            half_head = b"POST /generate HTTP/1.1\r\nHost: x\r\n"
            half_body = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"te"
            got = await asyncio.gather(answer(half_head), answer(half_body))
            assert all(g.startswith(b"HTTP/1.1 408") for g in got), got
            # a kept-alive connection left idle is closed
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_raw_request(gen("ok", 1)))
            first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
            assert first.startswith(b"HTTP/1.1 200")
            rest = await asyncio.wait_for(reader.read(), 10.0)  # body, then EOF once idle
            assert rest.endswith(b"}") and reader.at_eof()
            writer.close()
            # four half-open connections from one address; the fifth is refused at once
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
            data = await answer(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert data.startswith(b"HTTP/1.1 503") and b"too many connections" in data
            for _, w in held:
                w.close()
            assert counter(router, "kllm_bigpd_router_client_connections_closed_total", reason="client_cap") >= 1
            assert counter(router, "kllm_bigpd_router_client_connections_closed_total",
                           reason="header_timeout") >= 1
            async with aiohttp.ClientSession() as s:
                async with s.get(rurl + "/health") as r:
                    assert r.status == 200
    run(go)


# ---------------------------------------------------------------- routes
def test_flush_cache_reaches_every_instance_and_server_info_is_answered() -> None:
    async def go() -> None:
        backends = [FakeBackend(), FakeBackend()]
        async with cluster(backends, RouterConfig(**QUIET)) as (router, rurl, urls), aiohttp.ClientSession() as s:
            async with s.post(rurl + "/flush_cache", params={"timeout": "5"}) as r:
                assert r.status == 200, await r.text()
            assert [b.flushes for b in backends] == [1, 1]
            for path in ("/server_info", "/get_server_info"):
                async with s.get(rurl + path) as r:
                    assert r.status == 200 and (await r.json())["max_total_num_tokens"] == 4096
            for path in ("/model_info", "/get_model_info", "/v1/models"):
                async with s.get(rurl + path) as r:
                    assert r.status == 200, path
            backends[1].dead = True  # a failed flush is reported, not hidden
            router.registry.get(urls[1]).health = Health.HEALTHY  # type: ignore[union-attr]
            async with s.post(rurl + "/flush_cache") as r:
                assert r.status == 502 and "1 of 2" in (await r.json())["error"]["message"]
    run(go)


def test_server_info_in_pd_mode_lists_both_pools() -> None:
    async def go() -> None:
        backends = [FakeBackend(role="prefill"), FakeBackend(role="decode")]
        async with cluster(backends, RouterConfig(**QUIET), ["prefill", "decode"]) as (router, rurl, urls), \
                aiohttp.ClientSession() as s:
            assert router.pd_mode() and router.registry.get(urls[0]).role is Role.PREFILL  # type: ignore[union-attr]
            async with s.get(rurl + "/server_info") as r:
                info = await r.json()
            assert [i["disaggregation_mode"] for i in info["prefill"]] == ["prefill"]
            assert [i["disaggregation_mode"] for i in info["decode"]] == ["decode"]
    run(go)


# ---------------------------------------------------------------- a stopped instance (SIGSTOP)
@pytest.mark.slow
def test_stopped_instance_is_detected_in_seconds_and_its_requests_fail_over_or_end_cleanly() -> None:
    import os
    import signal
    import subprocess
    import time

    from kllm_plugins.plugins.bigpd_router.actuators.local_process import free_port

    ports = [free_port(), free_port()]
    procs = [subprocess.Popen([sys.executable, "-m", "kllm_plugins.plugins.bigpd_router.service.fake_backend",
                               "--port", str(p), "--ttft-s", "0.5", "--tpot-s", "0.05"]) for p in ports]

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for p in ports:
                for _ in range(200):
                    try:
                        async with s.get(f"http://127.0.0.1:{p}/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        await asyncio.sleep(0.1)
        # health checks as patient as the defaults; detection must come from liveness and the watchdog
        cfg = RouterConfig(policy="round_robin", loads_interval_s=0, health_interval_s=2.0)
        from kllm_plugins.plugins.bigpd_router.service.router import Router

        router = Router(cfg)
        async with router.serving() as rurl, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            for u in urls:
                await router.add_instance(u)
            started = [asyncio.Event() for _ in range(4)]

            async def stream(i: int, n: int) -> tuple[str, bytes]:
                async with s.post(rurl + "/generate", json=gen(f"s{i}", n, stream=True)) as r:
                    inst, body = r.headers.get("X-Kllm-Instance", ""), b""
                    async for piece in r.content.iter_any():
                        body += piece
                        if i < len(started):
                            started[i].set()
                    return inst, body

            long_streams = [asyncio.create_task(stream(i, 200)) for i in range(4)]  # 10 s each
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
            waiting = [asyncio.create_task(stream(10 + i, 5)) for i in range(4)]  # no token for 0.5 s
            os.kill(procs[0].pid, signal.SIGSTOP)
            t_stop = time.monotonic()
            assert await wait_for(lambda: router.registry.get(urls[0]).health is Health.UNHEALTHY,  # type: ignore[union-attr]
                                  30.0, 0.05)
            detect_s = time.monotonic() - t_stop
            results = await asyncio.wait_for(asyncio.gather(*waiting), 30)
            ended = await asyncio.wait_for(asyncio.gather(*long_streams), 30)
            took = time.monotonic() - t_stop
        await asyncio.sleep(0)
        assert detect_s < 8.0, detect_s  # the old health checks alone took 13.6 s
        # requests with no token yet were retried on the running instance and completed
        for inst, body in results:
            assert body.count(b"data:") == 6 and b"error" not in body, body
        # streams already started on the stopped one ended with an error event, not a hang
        stopped = [b for inst, b in ended if inst == urls[0]]
        assert stopped and all(b"stopped answering" in b and b.endswith(b"data: [DONE]\n\n") for b in stopped)
        assert all(b.count(b"data:") == 201 for inst, b in ended if inst == urls[1])
        assert took < 25.0

    try:
        run(go, 120)
    finally:
        for p in procs:
            with contextlib_suppress():
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait(10)


def contextlib_suppress() -> object:
    import contextlib

    return contextlib.suppress(OSError)
