"""Scaling on a shifting trace with real tiny-model SGLang servers on this CPU (not a simulation).

Plain servers stand in for the pools (two cores cannot hold PD pairs plus spares): setup
"fixed" is two instances for the whole run; setup "pools" is kllm-router's controller with the
local-process actuator, min 1 / max 2, starting from one. Both get the same closed-loop trace
whose mix shifts: short prompts with long outputs (decode-heavy), then more clients with long
prompts and short outputs (prefill-heavy), then quiet. Reported per setup and per phase: SLO
attainment (TTFT <= --ttft-target-s and TPOT <= --tpot-target-s) and instance-seconds (each
instance from its start to its stop, start-up of added instances included).

    python benchmarks/bigpd_router/bench_scaling_real.py --phase-s 40 80 40 --clients 1 4 1
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

sys.path.insert(0, os.path.dirname(__file__))
from loadgen import merge_results  # noqa: E402

from kllm_plugins.bench.client import astream  # noqa: E402

from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator  # noqa: E402
from kllm_plugins.plugins.bigpd_router.config import RouterConfig  # noqa: E402
from kllm_plugins.plugins.bigpd_router.core.registry import Role  # noqa: E402
from kllm_plugins.plugins.bigpd_router.service.router import Router  # noqa: E402

ARGS = ["--max-total-tokens", "4096", "--sleep-on-idle"]


MIX = [(10, 64), (120, 4), (10, 16)]
"""(prompt repetitions of a ~6-token phrase, output tokens) per phase: decode-heavy, prefill-heavy, quiet."""


async def drive(rurl: str, phases: list[tuple[float, int]], ttft_target: float,
                tpot_target: float) -> list[tuple[int, int]]:
    per_phase: list[tuple[int, int]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        for p, (duration, clients) in enumerate(phases):
            end = time.monotonic() + duration
            reps, out = MIX[min(p, len(MIX) - 1)]
            ok = total = 0

            async def client(c: int) -> None:
                nonlocal ok, total
                i = 0
                while time.monotonic() < end:
                    i += 1
                    body = {"text": f"phase {p} client {c} request {i} " * reps, "stream": True,
                            "sampling_params": {"max_new_tokens": out, "temperature": 0, "ignore_eos": True}}
                    r = await astream(s, rurl + "/generate", body, meta=False)
                    total += 1
                    first, last = r.ttft_s, r.last_chunk_s  # NaN when nothing came
                    tpot = (last - first) / max(1, r.events - 2) if first == first and last == last else 0.0
                    ok += r.status == 200 and first == first and first <= ttft_target and tpot <= tpot_target

            await asyncio.gather(*(client(c) for c in range(clients)))
            per_phase.append((ok, total))
    return per_phase


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
    cfg = RouterConfig(ttft_target_s=args.ttft_target_s, tpot_target_s=args.tpot_target_s, health_interval_s=1.0,
                       loads_interval_s=1.0, scale_interval_s=1.0, scale_up_sustain_s=4.0, scale_down_sustain_s=15.0,
                       scale_cooldown_s=10.0, load_window_s=10.0, min_instances=n0, scale_urgent_load=2.0,
                       max_instances=2 if setup == "pools" else n0)
    router = Router(cfg, act, (Role.PLAIN,))
    port = await router.serve("127.0.0.1", 0)
    rurl = f"http://127.0.0.1:{port}"
    try:
        while len(router.registry.pool(Role.PLAIN, routable_only=True)) < n0:
            await asyncio.sleep(0.5)
        t0 = time.monotonic()
        for u in lifetimes:  # start-up before the trace is the same for both setups: not counted
            lifetimes[u][0] = t0
        per_phase = await drive(rurl, phases, args.ttft_target_s, args.tpot_target_s)
        t1 = time.monotonic()
        decisions = [(round(d.at - t0), d.action, d.count)
                     for d in (router.controller.decisions if router.controller else [])]
    finally:
        await router.shutdown(5)
        act.stop_all()
    inst_s = sum(min(end if end == end else t1, t1) - start for start, end in lifetimes.values())
    ok, total = sum(o for o, _ in per_phase), sum(n for _, n in per_phase)
    return {"setup": setup, "simulated": False, "slo_attainment": round(ok / max(total, 1), 4),
            "instance_seconds": round(inst_s, 1), "requests": total, "ttft_target_s": args.ttft_target_s,
            "tpot_target_s": args.tpot_target_s,
            "per_phase": [{"attainment": round(o / max(n, 1), 4), "requests": n} for o, n in per_phase],
            "scale_decisions": decisions[-10:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase-s", type=float, nargs="+", default=[40, 80, 40])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 1])
    ap.add_argument("--ttft-target-s", type=float, default=0.5)
    ap.add_argument("--tpot-target-s", type=float, default=0.1)
    ap.add_argument("--setups", nargs="+", default=["fixed", "pools"])
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    phases = list(zip(args.phase_s, args.clients))
    rows = []
    for setup in args.setups:
        before = os.getloadavg()[0]
        rows.append(asyncio.run(run(setup, phases, args, str(tiny_llama_path()))))
        rows[-1]["load_avg_1min"] = [round(before, 2), round(os.getloadavg()[0], 2)]
    for r in rows:
        print(json.dumps(r))
    print("\nreal servers   SLO attainment  per phase              instance-seconds")
    for r in rows:
        name = "fixed (2)" if r["setup"] == "fixed" else "pools (1..2)"
        phases_txt = " ".join(f"{p['attainment']:.2f}" for p in r["per_phase"])
        print(f"{name:<14} {r['slo_attainment']:>14.3f}  {phases_txt:<22} {r['instance_seconds']:>16.0f}")
    if args.no_record:
        return
    command = " ".join(["python", *sys.argv])
    merge_results("scaling", rows, command, keep=lambda r: r.get("simulated"))
    summary = "; ".join(f"{r['setup']}: {r['slo_attainment']:.3f} (phases "
                        f"{', '.join(str(p['attainment']) for p in r['per_phase'])}), {r['instance_seconds']:.0f} "
                        f"instance-s, {r['requests']} req, decisions {r['scale_decisions']}, load average before/after "
                        f"{r['load_avg_1min']}" for r in rows)
    # the summary line (benchmarks/RESULTS.md is generated from the results files)
    print(f"| bigpd_router | REAL tiny-model CPU servers (plain servers standing in for pools), shifting mix "
          f"(decode-heavy, prefill-heavy, quiet), phases {args.phase_s} s, clients {args.clients}, TTFT <= "
          f"{args.ttft_target_s} s, TPOT <= {args.tpot_target_s} s; fixed 2 vs pool 1..2 with controller | "
          f"{summary} | `{command}` |")


if __name__ == "__main__":
    main()
