"""End to end: the scaling controller promotes a warm standby SGLang server and hands it back,
with traffic running through kllm-router (real tiny-model servers on the CPU platform).

Server A serves from the start (registered directly, not managed). The standby actuator keeps
one warm standby, B, started and warmed up but unregistered, and does not refill (two servers on
two cores). With requests flowing without pause: the pool minimum goes to 2, the controller
promotes B, and the router's check right after the scale step makes it routable at once (the
one health round runs at start-up, so no round can have done it); B then serves routed requests,
although its first request may have been slow (the router must not price a new instance out on
one measurement). The maximum goes to 1: the controller drains B (the managed one) and, once
idle, the actuator returns it to the pool, still running. The minimum goes to 2 again and the returned B is
promoted again and serves. Every request of the run must succeed with its full output.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator
from kllm_plugins.plugins.bigpd_router.actuators.standby_actuator import StandbyActuator
from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Role
from kllm_plugins.plugins.bigpd_router.core.standby_pool import StandbyPolicy, StandbyPool, State
from kllm_plugins.plugins.bigpd_router.service.router import Router
from kllm_plugins.testing.sglang_server import SGLangServer

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.slow]

N_TOKENS = 8


async def one_request(s: aiohttp.ClientSession, rurl: str, i: int, stream: bool) -> dict[str, Any]:
    body = {"text": f"request {i} says", "stream": stream,
            "sampling_params": {"max_new_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True}}
    async with s.post(rurl + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
        raw = await r.read()
        out: dict[str, Any] = {"i": i, "status": r.status, "instance": r.headers.get("X-Kllm-Instance", ""),
                               "stream": stream}
    if out["status"] != 200:
        out["error"] = raw[:200]
        return out
    if stream:
        events = [e[5:].strip() for e in raw.decode().split("\n\n") if e.startswith("data:")]
        out["done"] = events[-1] == "[DONE]"
        last = json.loads(events[-2]) if len(events) >= 2 else {}
        out["error"] = last.get("error")
        out["tokens"] = (last.get("meta_info") or {}).get("completion_tokens")
    else:
        out["done"] = True
        out["tokens"] = json.loads(raw)["meta_info"]["completion_tokens"]
    return out


def router_state(router: Router, results: list[dict[str, Any]]) -> str:
    """What the router believed about each instance, and who served what (for failure messages)."""
    lines = []
    for i in router.registry:
        lines.append(f"{i.url} health={i.health.value} in_flight={i.in_flight} pending={i.pending_prefill_tokens} "
                     f"rate={i.prefill_rate.value:.2f}/{i.prefill_rate.samples} tpot={i.tpot.value:.4f}/{i.tpot.samples}")
    served: dict[str, int] = {}
    for r in results:
        served[r["instance"]] = served.get(r["instance"], 0) + 1
    errors = [r for r in results if r["status"] != 200 or r.get("error")]
    return "; ".join(lines) + f"; served={served}; errors={errors[-3:]}"


async def wait_for(pred: Any, timeout_s: float, what: str, state: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {state() if state else ''}"
        await asyncio.sleep(0.05)


def test_standby_promotion_and_return_with_traffic_running(tiny_model_path: Path, tmp_path: Path) -> None:
    base = LocalProcessActuator(str(tiny_model_path), common_args=["--max-total-tokens", "4096", "--sleep-on-idle"],
                                env={"SGLANG_PLATFORM": "kllm_cpu", "KLLM_STRICT": "1"}, log_dir=str(tmp_path))
    act = StandbyActuator(base, StandbyPool(StandbyPolicy(size={Role.PLAIN: 1}, refill=False)), poll_s=0.2)
    server_a = SGLangServer(tiny_model_path, max_total_tokens=4096)
    cfg = RouterConfig(health_interval_s=3600, scale_interval_s=0.2, loads_interval_s=0, min_instances=1,
                       max_instances=2, scale_cooldown_s=0, scale_up_sustain_s=1e6, scale_down_sustain_s=1e6,
                       first_token_timeout_s=60, max_retries=1, drain_timeout_s=120)
    router = Router(cfg, act, (Role.PLAIN,))
    results: list[dict[str, Any]] = []
    standby: list[str] = []

    async def go() -> None:
        act.start()
        await asyncio.to_thread(server_a.start)
        assert await asyncio.to_thread(act.wait_filled, 600), "standby never became ready"
        b = act.pool.of(Role.PLAIN, State.READY)[0].url
        standby.append(b)
        assert router.controller is not None
        ctl = router.controller
        dec = ctl.deciders[Role.PLAIN]
        async with router.serving(shutdown_timeout_s=5) as rurl, aiohttp.ClientSession() as s:
            await router.add_instance(server_a.base_url, Role.PLAIN)
            stop = asyncio.Event()
            counter = iter(range(10**6))

            async def client(c: int) -> None:
                while not stop.is_set():
                    i = next(counter)
                    try:
                        results.append(await one_request(s, rurl, i, stream=bool(c % 2)))
                    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, IndexError) as exc:
                        results.append({"i": i, "status": -1, "instance": "", "stream": bool(c % 2),
                                        "done": False, "error": repr(exc)})

            def state() -> str:
                return router_state(router, results)

            clients = [asyncio.create_task(client(c)) for c in range(2)]
            try:
                await steps(b, ctl, dec, state, clients, stop)
            finally:
                stop.set()
                for t in clients:
                    t.cancel()
                await asyncio.gather(*clients, return_exceptions=True)

    async def steps(b: str, ctl: Any, dec: Any, state: Any, clients: list[Any], stop: asyncio.Event) -> None:
        # generous waits (CI's machine is a loaded 2-core box); each fails with what the router saw
        await wait_for(lambda: len(results) >= 4, 600, "traffic on A", state)

        # 1. promotion: the decision, then B routable without a health round
        dec.policy = dataclasses.replace(dec.policy, min_instances=2)
        await wait_for(lambda: any(d.action == "up" for d in ctl.decisions), 120, "the scale-up decision")
        await wait_for(lambda: (i := router.registry.get(b)) is not None and i.health is Health.HEALTHY, 180,
                       "the promoted standby to be routable")
        assert act.choices[b].kind == "promote"
        await wait_for(lambda: sum(r["instance"] == b for r in results) >= 3, 600, "requests served by B", state)

        # 2. demotion: B drains (no request lost) and goes back to the pool, still running
        dec.policy = dataclasses.replace(dec.policy, min_instances=1, max_instances=1)
        await wait_for(lambda: b in act.pool.members, 600, "B back in the pool")
        assert b not in router.registry and base.alive(b)
        assert act.pool.members[b].state is State.READY and act.pool.returned == 1
        n_after_return = len(results)
        await wait_for(lambda: len(results) >= n_after_return + 4, 600, "traffic on A alone", state)

        # 3. the returned standby is promoted again and serves
        dec.policy = dataclasses.replace(dec.policy, min_instances=2, max_instances=2)
        await wait_for(lambda: (i := router.registry.get(b)) is not None and i.health is Health.HEALTHY, 180,
                       "the returned standby promoted again")
        n_b = sum(r["instance"] == b for r in results)
        await wait_for(lambda: sum(r["instance"] == b for r in results) >= n_b + 2, 600, "B serving again", state)
        stop.set()
        await asyncio.gather(*clients)
        secs = ctl.instance_seconds()
        assert secs["standby"] > 0 and secs["serving"] > 0
        assert act.pool.promoted == 2 and act.pool.cold_fallbacks == 0

    try:
        asyncio.run(go())
    finally:
        act.stop_all()
        server_a.stop()
    bad = [r for r in results if r["status"] != 200 or not r["done"] or r.get("error") or r["tokens"] != N_TOKENS]
    assert not bad, f"{len(bad)} of {len(results)} requests failed: {bad[:3]}"
    assert {r["instance"] for r in results} == {server_a.base_url, *standby}
