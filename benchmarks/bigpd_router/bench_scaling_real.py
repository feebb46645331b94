"""Scaling on a load step with real tiny-model SGLang servers on this CPU (not a simulation).

Setup "fixed": two plain instances for the whole run. Setup "pools": kllm-router's controller
with the local-process actuator, min 1 / max 2 instances, starting from one. Both get the same
closed-loop trace: a few quiet clients, a burst of clients, quiet again. Reported: SLO attainment
(TTFT <= --ttft-target-s; TPOT is not the bottleneck on this tiny model) and instance-seconds
(each instance counted from its start to its stop, start-up included).

    python benchmarks/bigpd_router/bench_scaling_real.py --phase-s 40 60 40 --clients 1 6 1
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, os.path.dirname(__file__))
from loadgen import merge_results  # noqa: E402

from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator  # noqa: E402
from kllm_plugins.plugins.bigpd_router.config import RouterConfig  # noqa: E402
from kllm_plugins.plugins.bigpd_router.core.registry import Role  # noqa: E402
from kllm_plugins.plugins.bigpd_router.service.router import Router  # noqa: E402

ARGS = ["--max-total-tokens", "4096", "--sleep-on-idle"]


async def drive(rurl: str, phases: list[tuple[float, int]], ttft_target: float) -> tuple[int, int]:
    ok = total = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        for duration, clients in phases:
            end = time.monotonic() + duration

            async def client(c: int) -> None:
                nonlocal ok, total
                i = 0
                while time.monotonic() < end:
                    i += 1
                    body = {"text": f"client {c} request {i} " * 40, "stream": True,
                            "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
                    t0 = time.monotonic()
                    first = None
                    async with s.post(rurl + "/generate", json=body) as r:
                        async for _ in r.content.iter_any():
                            if first is None:
                                first = time.monotonic() - t0
                        total += 1
                        ok += r.status == 200 and first is not None and first <= ttft_target

            await asyncio.gather(*(client(c) for c in range(clients)))
    return ok, total


async def run(setup: str, phases: list[tuple[float, int]], args: argparse.Namespace, model: str) -> dict[str, Any]:
    env = {"SGLANG_PLATFORM": "kllm_cpu"}
    act = LocalProcessActuator(model, common_args=ARGS, env=env)
    lifetimes: dict[str, list[float]] = {}
    add, remove = act.add, act.remove

    def add_timed(role: Role) -> str:
        url = add(role)
        lifetimes[url] = [time.monotonic(), float("nan")]
        return url

    def remove_timed(url: str, role: Role | None = None) -> None:
        remove(url, role)
        lifetimes[url][1] = time.monotonic()

    act.add, act.remove = add_timed, remove_timed  # type: ignore[method-assign]
    n0 = 2 if setup == "fixed" else 1
    cfg = RouterConfig(ttft_target_s=args.ttft_target_s, health_interval_s=1.0, loads_interval_s=1.0,
                       scale_interval_s=2.0, scale_up_sustain_s=6.0, scale_down_sustain_s=20.0,
                       scale_cooldown_s=10.0, load_window_s=10.0, min_instances=n0,
                       max_instances=2 if setup == "pools" else n0)
    router = Router(cfg, act, (Role.PLAIN,))
    runner = web.AppRunner(router.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    rurl = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        while len(router.registry.pool(Role.PLAIN, routable_only=True)) < n0:
            await asyncio.sleep(0.5)
        t0 = time.monotonic()
        for u in lifetimes:  # start-up before the trace is the same for both setups: not counted
            lifetimes[u][0] = t0
        ok, total = await drive(rurl, phases, args.ttft_target_s)
        t1 = time.monotonic()
        decisions = [(round(d.at - t0), d.action, d.count)
                     for d in (router.controller.decisions if router.controller else [])]
    finally:
        await runner.cleanup()
        act.stop_all()
    inst_s = sum(min(end if end == end else t1, t1) - start for start, end in lifetimes.values())
    return {"setup": setup, "simulated": False, "slo_attainment": round(ok / max(total, 1), 4),
            "instance_seconds": round(inst_s, 1), "requests": total, "ttft_target_s": args.ttft_target_s,
            "scale_decisions": decisions[-10:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase-s", type=float, nargs="+", default=[40, 60, 40])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 6, 1])
    ap.add_argument("--ttft-target-s", type=float, default=0.5)
    args = ap.parse_args()
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    phases = list(zip(args.phase_s, args.clients))
    rows = [asyncio.run(run(setup, phases, args, str(tiny_llama_path()))) for setup in ("fixed", "pools")]
    for r in rows:
        print(json.dumps(r))
    f, p = rows
    print(f"\nreal servers   SLO attainment  instance-seconds\nfixed (2)      {f['slo_attainment']:>14.3f}  "
          f"{f['instance_seconds']:>16.0f}\npools (1..2)   {p['slo_attainment']:>14.3f}  {p['instance_seconds']:>16.0f}")
    merge_results("scaling_real", rows, " ".join(["python", *sys.argv]))


if __name__ == "__main__":
    main()
