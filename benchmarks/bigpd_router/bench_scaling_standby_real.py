"""A load step on real tiny-model SGLang servers on this CPU: cold start against a standby pool.

Not a simulation. Each instance is scaled down so that its own capacity, not the two shared
cores, is what runs out: `--max-running-requests 1` (one request at a time) and one torch thread
(`OMP_NUM_THREADS=1`), so two instances use at most two cores. The router's controller (min 1,
max 2, urgent trigger) scales the plain pool; setup "cold" adds the second instance by cold
start, setup "standby" promotes a warm standby (`StandbyActuator`, one standby, no refill).
Trace: `--clients` closed-loop clients per phase (a quiet phase, then the step). Reported per
setup and phase: SLO attainment (TTFT <= --ttft-target-s) and the controller's instance-seconds
(the first instance, added ones from their add, and the standby's time in the pool).

    python benchmarks/bigpd_router/bench_scaling_standby_real.py --phase-s 30 120 --clients 1 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import aiohttp

from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator
from kllm_plugins.plugins.bigpd_router.actuators.standby_actuator import StandbyActuator
from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.registry import Role
from kllm_plugins.plugins.bigpd_router.core.standby_pool import StandbyPolicy, StandbyPool
from kllm_plugins.plugins.bigpd_router.service.router import Router

RESULTS = "benchmarks/results/bigpd_router_standby_real.json"
ARGS = ["--max-total-tokens", "4096", "--sleep-on-idle", "--max-running-requests", "1"]


async def drive(rurl: str, phases: list[tuple[float, int]], ttft_target: float, out_tokens: int,
                log: list[tuple[float, int, float | None, str]]) -> list[tuple[int, int]]:
    per_phase = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        for p, (duration, clients) in enumerate(phases):
            end = time.monotonic() + duration
            ok = total = 0

            async def client(c: int) -> None:
                nonlocal ok, total
                i = 0
                while time.monotonic() < end:
                    i += 1
                    body = {"text": f"phase {p} client {c} request {i} " * 8, "stream": True,
                            "sampling_params": {"max_new_tokens": out_tokens, "temperature": 0, "ignore_eos": True}}
                    t0 = time.monotonic()
                    first = None
                    async with s.post(rurl + "/generate", json=body) as r:
                        async for _ in r.content.iter_any():
                            first = first if first is not None else time.monotonic() - t0
                        total += 1
                        good = r.status == 200 and first is not None and first <= ttft_target
                        ok += good
                        log.append((t0, r.status, first, r.headers.get("X-Kllm-Instance", "")))

            await asyncio.gather(*(client(c) for c in range(clients)))
            per_phase.append((ok, total))
    return per_phase


async def run(setup: str, args: argparse.Namespace, model: str) -> dict[str, Any]:
    env = {"SGLANG_PLATFORM": "kllm_cpu", "OMP_NUM_THREADS": "1"}
    base = LocalProcessActuator(model, common_args=ARGS, env=env)
    pool = StandbyPool(StandbyPolicy(size={Role.PLAIN: 1 if setup == "standby" else 0}, refill=False))
    act = StandbyActuator(base, pool)
    cfg = RouterConfig(ttft_target_s=args.ttft_target_s, health_interval_s=1.0, loads_interval_s=1.0,
                       scale_interval_s=0.5, scale_up_sustain_s=3.0, scale_down_sustain_s=1e6, scale_cooldown_s=5.0,
                       load_window_s=10.0, min_instances=1, max_instances=2, scale_urgent_load=2.0)
    router = Router(cfg, act, (Role.PLAIN,))
    log: list[tuple[float, int, float | None, str]] = []
    try:
        port = await router.serve("127.0.0.1", 0)
        rurl = f"http://127.0.0.1:{port}"
        # the first instance: the controller's minimum (a cold start in both setups), then the standby
        # (the filler starts afterwards, or the first scale-up would take the warming standby)
        while not router.registry.pool(Role.PLAIN, routable_only=True):
            await asyncio.sleep(0.5)
        act.start()
        if setup == "standby":
            await asyncio.to_thread(act.wait_filled, 900)
        assert router.controller is not None
        ctl = router.controller
        t0 = time.monotonic()
        secs0 = ctl.instance_seconds(t0)
        before = set(act.choices)
        per_phase = await drive(rurl, list(zip(args.phase_s, args.clients)), args.ttft_target_s, args.out_tokens, log)
        t1 = time.monotonic()
        secs1 = ctl.instance_seconds(t1)
        ups = [(round(d.at - t0, 1), d.reason) for d in ctl.decisions if d.action == "up" and d.at >= t0]
        second = [u for u in act.choices if u not in before]
        first_on_new = min((t for t, st, _, u in log if u in second and st == 200), default=None)
    finally:
        await router.shutdown(5)
        await asyncio.to_thread(act.stop_all)
    ok, total = sum(o for o, _ in per_phase), sum(n for _, n in per_phase)
    added = {k: round(secs1[k] - secs0[k], 1) for k in secs1}
    return {"setup": setup, "simulated": False, "slo_attainment": round(ok / max(total, 1), 4),
            "requests": total, "failed": sum(1 for _, st, _, _ in log if st != 200),
            "per_phase": [{"attainment": round(o / max(n, 1), 4), "requests": n} for o, n in per_phase],
            # the first instance serves the whole trace in both setups; the rest is the controller's
            "instance_seconds": added["total"],
            "instance_seconds_parts": added, "scale_ups": ups,
            "first_request_on_added_s": None if first_on_new is None or not ups else round(first_on_new - t0 - ups[0][0], 1),
            "how_added": [act.choices[u].kind for u in second]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase-s", type=float, nargs="+", default=[30, 120])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--ttft-target-s", type=float, default=1.0)
    ap.add_argument("--out-tokens", type=int, default=16)
    ap.add_argument("--setups", nargs="+", default=["standby", "cold"])
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    rows = []
    for setup in args.setups:
        before = os.getloadavg()[0]
        rows.append(asyncio.run(run(setup, args, str(tiny_llama_path()))))
        rows[-1]["load_avg_1min"] = [round(before, 2), round(os.getloadavg()[0], 2)]
        print(json.dumps(rows[-1]), flush=True)
    print("\nREAL tiny-model servers, load step   attainment  per phase     controller instance-s  "
          "decision -> first request on the added instance")
    for r in rows:
        print(f"  {r['setup']:<34} {r['slo_attainment']:>10.3f}  "
              f"{' '.join(str(p['attainment']) for p in r['per_phase']):<13} {r['instance_seconds']:>21.0f}  "
              f"{r['first_request_on_added_s']}")
    if args.no_record:
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump({"simulated": False, "command": " ".join(["python", *sys.argv]), "commit": commit,
                   "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "machine": {"cpus": os.cpu_count(), "shared": "2-core machine shared with five other sessions; "
                               "load averages recorded per setup"}, "rows": rows}, fh, indent=1)
    print(f"recorded {RESULTS}")


if __name__ == "__main__":
    main()
