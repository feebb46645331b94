"""A load step on real tiny-model SGLang servers on this CPU: no scaling, cold scale-up, standby pool.

Not a simulation. Each instance is scaled down so that its own capacity, not the two shared
cores, is what runs out: `--max-running-requests 1` (one request at a time) and one torch thread
(`OMP_NUM_THREADS=1`), so two instances use at most two cores. Requests are sized so that one
request takes about `--service-frac` of the TTFT target on an idle instance (calibrated once per
run on the first instance, directly, not through the router): with `--clients` 3 closed-loop
clients one instance queues each request behind about two others (TTFT over the target), two
instances keep it under. The router's controller (min 1, max 2, urgent trigger) scales the plain
pool. Setups, restarted from nothing and interleaved (the order rotates per repeat):
- none: max 1 instance, no scale-up (the baseline the step hurts);
- cold: the second instance by cold start (SGLang's way, what the controller did before);
- standby: one warm standby (`StandbyActuator`, no refill) promoted on the scale-up.
Trace: a quiet phase, then the step. Per setup: SLO attainment (TTFT <= --ttft-target-s) per
phase; the SLO-violation window after the step (seconds of `--bin-s` bins, by send time, whose
attainment is below `--bin-slo`) and when the last such bin ends; the controller's
instance-seconds over the trace (the first instance, the added one from its add, and the
standby's idle time in the pool: the price of the pool); decision to the first request served by
the added instance.

    python benchmarks/bigpd_router/bench_scaling_standby_real.py --phase-s 20 70 --clients 1 3 --repeats 1
    python benchmarks/bigpd_router/bench_scaling_standby_real.py --phase-s 20 70 --clients 1 3 --repeats 1 --append
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

import aiohttp

from kllm_plugins.bench.client import astream
from kllm_plugins.bench.record import build_summary, git_commit, result_path, write_summary
from kllm_plugins.bench.stats import ratio_of_medians, spread
from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator
from kllm_plugins.plugins.bigpd_router.actuators.standby_actuator import StandbyActuator, http_json
from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.registry import Role
from kllm_plugins.plugins.bigpd_router.core.standby_pool import StandbyPolicy, StandbyPool
from kllm_plugins.plugins.bigpd_router.service.router import Router

RESULT_NAME = "standby_real"
"""benchmarks/results/bigpd_router/standby_real.json"""
ARGS = ["--max-total-tokens", "4096", "--sleep-on-idle", "--max-running-requests", "1"]
SETUPS = ("none", "cold", "standby")
SHARED = "shared 2-core, several helpers (benchmarks serialised by a machine-wide lock; tests may run)"
Log = list[tuple[float, int, float | None, str, int]]
"""(sent, status, TTFT or None, instance, phase) per request."""


def prompt(p: int, c: int, i: int) -> str:
    return f"phase {p} client {c} request {i} " * 8


def calibrate(url: str, ttft_target: float, frac: float) -> dict[str, Any]:
    """Output tokens for one request to take about `frac` * target on the idle instance at `url`."""
    body = {"text": prompt(9, 9, 9), "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}
    http_json(url + "/generate", body, timeout_s=120)  # warm-up
    times = []
    for n in (8, 40):  # two lengths: the per-token time without the fixed part
        body["sampling_params"]["max_new_tokens"] = n
        samples = []
        for _ in range(3):
            t0 = time.monotonic()
            http_json(url + "/generate", body, timeout_s=120)
            samples.append(time.monotonic() - t0)
        times.append(statistics.median(samples))
    per_token = max(1e-3, (times[1] - times[0]) / 32)
    tokens = int(max(8, min(400, (frac * ttft_target - times[0]) / per_token + 8)))
    return {"out_tokens": tokens, "s_8_tokens": round(times[0], 4), "s_per_token": round(per_token, 5)}


async def drive(rurl: str, phases: list[tuple[float, int]], out_tokens: int, log: Log) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        for p, (duration, clients) in enumerate(phases):
            end = time.monotonic() + duration

            async def client(c: int) -> None:
                i = 0
                while time.monotonic() < end:
                    i += 1
                    body = {"text": prompt(p, c, i), "stream": True,
                            "sampling_params": {"max_new_tokens": out_tokens, "temperature": 0, "ignore_eos": True}}
                    t0 = time.monotonic()
                    r = await astream(s, rurl + "/generate", body, meta=False)
                    status = -1 if r.broken else r.status
                    first = r.ttft_s if r.ttft_s == r.ttft_s else None
                    log.append((t0, status, first, r.headers.get("X-Kllm-Instance", ""), p))

            await asyncio.gather(*(client(c) for c in range(clients)))


def violation(log: Log, step_at: float, step_end: float, target: float, bin_s: float,
              bin_slo: float) -> dict[str, Any]:
    """Bins of the step phase (by send time) whose attainment is below `bin_slo`."""
    n = max(1, int(round((step_end - step_at) / bin_s)))
    good, total = [0] * n, [0] * n
    for t0, st, ttft, _, _ in log:
        if step_at <= t0 < step_end:
            b = min(n - 1, int((t0 - step_at) / bin_s))
            total[b] += 1
            good[b] += st == 200 and ttft is not None and ttft <= target
    bad = [b for b in range(n) if total[b] == 0 or good[b] / total[b] < bin_slo]
    return {"violation_window_s": round(len(bad) * bin_s, 1),
            "recovered_after_s": round((max(bad) + 1) * bin_s, 1) if bad else 0.0,
            "bins_attainment": [round(g / t, 2) if t else None for g, t in zip(good, total)]}


async def run(setup: str, args: argparse.Namespace, model: str, calib: dict[str, Any] | None) -> dict[str, Any]:
    env = {"SGLANG_PLATFORM": "kllm_cpu", "OMP_NUM_THREADS": "1"}
    base = LocalProcessActuator(model, common_args=ARGS, env=env)
    pool = StandbyPool(StandbyPolicy(size={Role.PLAIN: 1 if setup == "standby" else 0}, refill=False))
    act = StandbyActuator(base, pool)
    cfg = RouterConfig(ttft_target_s=args.ttft_target_s, health_interval_s=1.0, loads_interval_s=1.0,
                       scale_interval_s=0.5, scale_up_sustain_s=3.0, scale_down_sustain_s=1e6, scale_cooldown_s=5.0,
                       load_window_s=10.0, min_instances=1, max_instances=1 if setup == "none" else 2,
                       scale_urgent_load=2.0)
    router = Router(cfg, act, (Role.PLAIN,))
    log: Log = []
    try:
        port = await router.serve("127.0.0.1", 0)
        rurl = f"http://127.0.0.1:{port}"
        # the first instance: the controller's minimum (a cold start in every setup), then the standby
        # (the filler starts afterwards, or the first scale-up would take the warming standby)
        while not router.registry.pool(Role.PLAIN, routable_only=True):
            await asyncio.sleep(0.5)
        first_url = router.registry.pool(Role.PLAIN, routable_only=True)[0].url
        if calib is None:
            calib = await asyncio.to_thread(calibrate, first_url, args.ttft_target_s, args.service_frac)
            print(f"calibrated on {first_url}: {json.dumps(calib)}", flush=True)
        act.start()
        if setup == "standby" and not await asyncio.to_thread(act.wait_filled, 600):
            raise TimeoutError("standby pool not filled within 600 s")
        standby_memory = pool.memory_bytes()
        assert router.controller is not None
        ctl = router.controller
        load_before = os.getloadavg()[0]
        t0 = time.monotonic()
        secs0 = ctl.instance_seconds(t0)
        before = set(act.choices)
        await drive(rurl, list(zip(args.phase_s, args.clients)), calib["out_tokens"], log)
        t1 = time.monotonic()
        secs1 = ctl.instance_seconds(t1)
        ups = [(round(d.at - t0, 1), d.reason) for d in ctl.decisions if d.action == "up" and d.at >= t0]
        added = [u for u in act.choices if u not in before]
        first_on_new = min((t + (ttft or 0) for t, st, ttft, u, _ in log if u in added and st == 200), default=None)
    finally:
        await router.shutdown(5)
        await asyncio.to_thread(act.stop_all)
    step_at = t0 + sum(args.phase_s[:-1])
    per_phase = []
    for p in range(len(args.phase_s)):
        sel = [r for r in log if r[4] == p]
        ok = sum(1 for _, st, ttft, _, _ in sel if st == 200 and ttft is not None and ttft <= args.ttft_target_s)
        ttfts = [ttft for _, st, ttft, _, _ in sel if ttft is not None]
        per_phase.append({"attainment": round(ok / max(len(sel), 1), 4), "requests": len(sel),
                          "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None})
    ok_all = sum(1 for _, st, ttft, _, _ in log if st == 200 and ttft is not None and ttft <= args.ttft_target_s)
    parts = {k: round(secs1[k] - secs0[k], 1) for k in secs1}
    return {"setup": setup, "calibration": calib, "out_tokens": calib["out_tokens"],
            "slo_attainment": round(ok_all / max(len(log), 1), 4), "requests": len(log),
            "failed": sum(1 for _, st, _, _, _ in log if st != 200), "per_phase": per_phase,
            **violation(log, step_at, t1, args.ttft_target_s, args.bin_s, args.bin_slo),
            # the first instance serves the whole trace in every setup; the rest is the controller's
            "instance_seconds": parts["total"], "instance_seconds_parts": parts,
            "standby_memory_bytes": standby_memory, "scale_ups": ups,
            "decision_to_first_served_on_added_s": None if first_on_new is None or not ups
            else round(first_on_new - t0 - ups[0][0], 2),
            "how_added": [act.choices[u].kind for u in added],
            "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setup: spreads over repeats; ratios of standby and cold against each other and none."""
    out: dict[str, Any] = {}
    figures = {"violation_window_s": lambda r: r["violation_window_s"],
               "recovered_after_s": lambda r: r["recovered_after_s"],
               "step_attainment": lambda r: r["per_phase"][-1]["attainment"],
               "slo_attainment": lambda r: r["slo_attainment"],
               "instance_seconds": lambda r: r["instance_seconds"],
               "standby_idle_seconds": lambda r: r["instance_seconds_parts"]["standby"],
               "decision_to_first_served_on_added_s": lambda r: r["decision_to_first_served_on_added_s"]}
    for setup in SETUPS:
        sel = [r for r in rows if r["setup"] == setup]
        if not sel:
            continue
        out[setup] = {"repeats": len(sel), "failed_requests": sum(r["failed"] for r in sel)}
        for name, get in figures.items():
            vals = [get(r) for r in sel if get(r) is not None]
            if vals:
                out[setup][name] = spread(vals)
    ratios: dict[str, Any] = {}
    for ours, basis in (("standby", "cold"), ("standby", "none"), ("cold", "none")):
        a = [r for r in rows if r["setup"] == ours]
        b = [r for r in rows if r["setup"] == basis]
        if not a or not b:
            continue
        for name in ("violation_window_s", "instance_seconds"):
            try:
                ratios[f"{ours}_over_{basis}_{name}"] = ratio_of_medians([r[name] for r in a], [r[name] for r in b],
                                                                        paired=False)
            except ValueError as exc:  # a zero baseline (no violation at all)
                ratios[f"{ours}_over_{basis}_{name}"] = str(exc)
    out["ratios"] = ratios
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase-s", type=float, nargs="+", default=[20, 70])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--ttft-target-s", type=float, default=1.0)
    ap.add_argument("--service-frac", type=float, default=0.6,
                    help="one request's time on an idle instance, as a share of the TTFT target (sets its length)")
    ap.add_argument("--out-tokens", type=int, default=0, help="fixed request length (0: calibrate)")
    ap.add_argument("--bin-s", type=float, default=5.0)
    ap.add_argument("--bin-slo", type=float, default=0.9, help="a bin below this attainment is a violation")
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--append", action="store_true", help="add to the recorded rows (same trace) instead of replacing")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if len(args.phase_s) != len(args.clients) or len(args.phase_s) < 2:
        raise SystemExit("bench_scaling_standby_real: --phase-s and --clients need the same length, at least 2")
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    path = result_path("bigpd_router", RESULT_NAME)
    trace = {"phase_s": args.phase_s, "clients": args.clients, "ttft_target_s": args.ttft_target_s,
             "service_frac": args.service_frac, "bin_s": args.bin_s, "bin_slo": args.bin_slo}
    old_rows: list[dict[str, Any]] = []
    if args.append and path.exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        if old.get("trace") != trace:
            raise SystemExit(f"--append: {path} holds another trace ({old.get('trace')}); run without --append")
        old_rows = old.get("rows", [])
    offset = len({r.get("run_repeat") for r in old_rows})
    calib = None if args.out_tokens == 0 else {"out_tokens": args.out_tokens, "fixed": True}
    if old_rows and calib is None:
        calib = old_rows[0]["calibration"]  # one request length for every repeat of the recorded trace
    rows: list[dict[str, Any]] = []
    run_id = f"{git_commit()}@{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    for rep in range(args.repeats):
        k = (rep + offset) % len(args.setups)
        for setup in args.setups[k:] + args.setups[:k]:  # interleaved, rotating order
            row = asyncio.run(run(setup, args, str(tiny_llama_path()), calib))
            calib = row["calibration"]
            row["run_repeat"] = f"{run_id}#{rep}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    all_rows = old_rows + rows
    metrics = summarize(all_rows)
    print("\nREAL tiny-model SGLang servers, load step; median [min-max] over repeats")
    print(f"  {'setup':<8} {'step attainment':>22} {'violation window s':>22} {'instance-s':>22} "
          f"{'standby idle s':>18} {'decision->served s':>20}")

    def cell(d: dict[str, Any] | None, digits: int = 1) -> str:
        return "-" if not d else f"{d['median']:.{digits}f} [{d['min']:.{digits}f}-{d['max']:.{digits}f}]"

    for setup in SETUPS:
        m = metrics.get(setup)
        if m:
            print(f"  {setup:<8} {cell(m.get('step_attainment'), 3):>22} {cell(m.get('violation_window_s')):>22} "
                  f"{cell(m.get('instance_seconds')):>22} {cell(m.get('standby_idle_seconds')):>18} "
                  f"{cell(m.get('decision_to_first_served_on_added_s'), 2):>20}")
    for name, r in metrics["ratios"].items():
        print(f"  {name}: " + (f"{r['ratio']:.3f} [{r['min']:.3f}-{r['max']:.3f}]" if isinstance(r, dict) else r))
    if args.no_record:
        return
    data = build_summary(
        " ".join(["python", *sys.argv]), metrics, shared=SHARED, simulated=False, trace=trace,
        notes="Real SGLang 0.5.23 tiny-model servers on the kllm CPU platform behind kllm-router, one torch thread "
              "and one running request each; every setup restarts its servers; setups interleaved with a rotating "
              "order. Violation window: seconds of the step phase in bins (by send time) under bin_slo attainment. "
              "instance_seconds: over the trace, the first instance included (equal in every setup); "
              "standby_idle_seconds: the standby's time in the pool before its promotion, the pool's price.",
        rows=all_rows)
    write_summary(path, data)
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
