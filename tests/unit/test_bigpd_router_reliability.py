"""Reliability (no SGLang): soak of concurrent streams, scaling on a load step with real child
processes (the local-process actuator running the fake backend), graceful shutdown of kllm-router."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
import urllib.request

import aiohttp
import pytest

from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator, free_port
from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Role
from kllm_plugins.plugins.bigpd_router.service.fake_backend import FakeBackend
from kllm_plugins.plugins.bigpd_router.service.router import Router

from test_bigpd_router_service import cluster, gen, run, serve  # type: ignore[import-not-found]

FAKE = "kllm_plugins.plugins.bigpd_router.service.fake_backend"


@pytest.mark.slow
def test_soak_1000_concurrent_streams_leaks_nothing() -> None:
    async def go() -> None:
        backends = [FakeBackend(tpot_s=0.005, record=False), FakeBackend(tpot_s=0.005, record=False)]
        # no liveness probes: router, backends and 1000 clients share one event loop here, which a
        # loaded machine slows past any probe timeout (the soak is about leaks, not failover)
        cfg = RouterConfig(policy="least_load", health_interval_s=1.0, loads_interval_s=0, liveness_interval_s=0)
        async with cluster(backends, cfg) as (router, rurl, urls):
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
                async def one(i: int) -> int:
                    async with s.post(rurl + "/generate", json=gen(f"soak {i}", 4, stream=True)) as r:
                        body = await r.read()
                        return body.count(b"data:") if r.status == 200 else -1

                async def wave(n: int) -> list[int]:
                    return await asyncio.gather(*(one(i) for i in range(n)))

                # the first waves grow every pool (keep-alive connections, their handler tasks and
                # parser buffers); a further identical wave must not grow anything
                counts = await wave(1000)
                tracemalloc.start()
                counts += await wave(1000)
                await asyncio.sleep(0.5)
                gc.collect()
                tasks_before, mem_before = len(asyncio.all_tasks()), tracemalloc.get_traced_memory()[0]
                counts += await wave(1000)
                await asyncio.sleep(0.5)
                gc.collect()
                tasks_after, mem_after = len(asyncio.all_tasks()), tracemalloc.get_traced_memory()[0]
                tracemalloc.stop()
            assert counts == [5] * 3000  # 4 tokens + [DONE], every stream complete
            assert tasks_after <= 2300  # <= 1000 client-side + ~1100 upstream keep-alive handlers
            # keep-alive connections (one handler task each) may grow by the few opened by health
            # checks while every pooled one was busy; they expire after keepalive_timeout
            assert tasks_after <= tasks_before * 1.05 + 10, (tasks_before, tasks_after)
            grown = mem_after - mem_before
            assert grown < 4 * 1024 * 1024, f"memory grew by {grown} bytes over 1000 more streams"
            for u in urls:
                inst = router.registry.get(u)
                assert inst is not None
                assert (inst.in_flight, inst.decoding, inst.pending_prefill_tokens) == (0, 0, 0)
            # the router's upstream pool keeps a bounded set of keep-alive connections, and every
            # connection it opened is either idle in the pool or was closed
            pool = router.proxy.pool
            assert pool.open == pool.idle_count() <= 1100
    run(go, 240)


@pytest.mark.slow
def test_controller_scales_up_on_a_load_step_and_drains_down_after(tmp_path: object) -> None:
    act = LocalProcessActuator("unused", common_args=["--ttft-s", "0.1"], module=FAKE, python=sys.executable,
                               stop_grace_s=5, log_dir=str(tmp_path))
    cfg = RouterConfig(ttft_target_s=0.05, health_interval_s=0.2, loads_interval_s=0, scale_interval_s=0.2,
                       scale_up_sustain_s=0.4, scale_down_sustain_s=1.0, scale_cooldown_s=1.0, load_window_s=1.0,
                       min_instances=1, max_instances=2, drain_timeout_s=10)

    async def go() -> None:
        router = Router(cfg, act, (Role.PLAIN,))
        async with router.serving() as rurl, aiohttp.ClientSession() as s:
            async def wait_for(pred: object, timeout: float) -> None:
                deadline = time.monotonic() + timeout
                while not pred():  # type: ignore[operator]
                    assert time.monotonic() < deadline, [i.snapshot() for i in router.registry]
                    await asyncio.sleep(0.1)

            def healthy() -> int:
                return len(router.registry.pool(Role.PLAIN, routable_only=True))

            await wait_for(lambda: healthy() == 1, 30)  # below minimum: started at once
            sizes = []
            stop_at = time.monotonic() + 4.0

            async def client() -> None:
                while time.monotonic() < stop_at:
                    async with s.post(rurl + "/generate", json=gen("step", 2, stream=True)) as r:
                        assert r.status == 200
                        await r.read()
                    sizes.append(len(router.registry.pool(Role.PLAIN)))

            await asyncio.gather(*(client() for _ in range(4)))
            await wait_for(lambda: healthy() == 2, 30)
            procs = dict(act.procs)
            assert len(procs) == 2
            # load is gone: one instance drains and is stopped, never going under the minimum
            await wait_for(lambda: len(router.registry) == 1 and len(act.procs) == 1, 30)
            [gone] = set(procs) - set(act.procs)
            await wait_for(lambda: procs[gone].poll() is not None, 15)  # the process was stopped
            decisions = [(d.action, d.role) for d in router.controller.decisions]  # type: ignore[union-attr]
            assert decisions[0] == ("up", Role.PLAIN) and ("down", Role.PLAIN) in decisions
            assert min(sizes) >= 1
    try:
        run(go)
    finally:
        act.stop_all()


def test_graceful_shutdown_finishes_streams_in_flight() -> None:
    bport, rport = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    backend = subprocess.Popen([sys.executable, "-m", FAKE, "--port", str(bport), "--tpot-s", "0.05"],
                               start_new_session=True, env=env)
    router = subprocess.Popen([sys.executable, "-m", "kllm_plugins.plugins.bigpd_router.service.cli",
                               "--port", str(rport), "--worker", f"http://127.0.0.1:{bport}",
                               "--health-interval-s", "0.2", "--shutdown-timeout-s", "10"],
                              start_new_session=True, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{rport}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline and router.poll() is None
            time.sleep(0.2)

        async def go() -> None:
            async with aiohttp.ClientSession() as s:
                async def stream() -> bytes:
                    async with s.post(f"http://127.0.0.1:{rport}/generate", json=gen("long", 30, stream=True)) as r:
                        return await r.read()

                t = asyncio.create_task(stream())
                await asyncio.sleep(0.5)
                router.send_signal(signal.SIGTERM)
                body = await t
                assert body.count(b"data:") == 31  # the stream in flight was allowed to finish
        asyncio.run(go())
        assert router.wait(timeout=20) == 0
        logs = router.stderr.read().decode() if router.stderr else ""
        lines = [json.loads(ln) for ln in logs.splitlines() if ln.startswith("{")]
        assert any(ln.get("status") == 200 and ln.get("endpoint") == "generate" for ln in lines)  # structured logs
    finally:
        for p in (router, backend):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
