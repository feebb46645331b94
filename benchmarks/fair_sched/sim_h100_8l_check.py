"""Does the simulated clock, costed for the model the GPU ran, reproduce the 8-layer H100 run? (a
model, not a measurement)

The H100 run of `issue` and `lognormal` at chunk 2048 used 8 layers of the 8B width
(`gpu_issue_lognormal_2048_8l_timing_fixed.json`), so `sim_gpu_replay.py`, costed on the 32-layer
H200, does not model it. Here `sim_engine.COSTS["h100_8l"]` is fitted to that run itself (its two
solo long prompts; the decode step to fcfs's TPOT on the H100 cells, `sim_decode_fit.py`), and the
run's cells are replayed as
`sim_gpu_replay.simulate_cell` replays the H200's: the same trace scale, requests, load and
calibration, on seed 0 (the seed the GPU ran) and over `--seeds` seeds, the policy reading the clock
as under SGLang's overlap scheduler with fair_sched's one-pass lag. Printed side by side with the
GPU: capacity, and TPOT / P99 / mean against fcfs for the stock orders, fair_sched's defaults and
`decode_time_share` 0.2 (`decode_share` 0), with decode's share of the time while prompts waited;
once with no KV limit (as the H200 replay) and once with the run's KV pool (57,344 tokens a
server; `sim_engine.Engine.pool`, a simplified SGLang admission).

    python benchmarks/fair_sched/sim_h100_8l_check.py --seeds 20 [--record]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grid  # noqa: E402
import sim_engine as se  # noqa: E402
import traces as tr  # noqa: E402
from sim_gpu_replay import seed_runs  # noqa: E402

from kllm_plugins.bench.record import record  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "results" / "fair_sched" / "gpu_issue_lognormal_2048_8l_timing_fixed.json"
OUT = "sim_h100_8l_check"  # benchmarks/results/fair_sched/<this>.json
SETUPS = {  # name: (policy, fair_sched options); fair_sched reads the clock with the one-pass lag
    "shortest-prefill-first": ("shortest-prefill-first", None),
    "hrrn": ("hrrn", None),
    "fair_sched": ("fair_sched", []),
    "fair_sched/ts2": ("fair_sched", ["decode_share=0", "decode_time_share=0.2"]),
}
KEYS = {"tpot": ("tpot_s", "mean"), "p99": ("ttft_s", "p99"), "mean": ("ttft_s", "mean")}


def replay(trace: str, s: dict[str, Any], seeds: int, pool: int | None = None) -> dict[str, Any]:
    """The model's capacity and, per setup, its ratios to fcfs on seed 0 and of `seeds`-seed means;
    `pool`: with a KV pool of that many tokens (`sim_engine.Engine.pool`), capacity included."""
    scale = tr.gpu_scale(s["trace_chunk"], s["max_prompt"], *s["output_tokens"])
    cm, chunk = se.COSTS["h100_8l"], s["chunks"][0]
    cap = se.capacity(tr.make(trace, scale, s["cal_requests"], 99), chunk, cm, pool_tokens=pool)
    jobs = [tr.make(trace, scale, s["requests"], seed) for seed in range(seeds)]
    # stock orders on the plain clock, fair_sched as under SGLang's overlap scheduler with its lag
    runs = functools.partial(seed_runs, jobs, s["load"] * cap, chunk, cm, 8 * s["trace_chunk"] - 1, pool=pool)

    fcfs = runs("fcfs", [])
    out: dict[str, Any] = {"capacity_req_s": round(cap, 3)}
    for name, (policy, env) in SETUPS.items():
        rs = runs(policy, env or [], overlap=env is not None, lag=1)
        cell = {"seed0": {k: round(rs[0][k] / fcfs[0][k], 3) for k in KEYS},
                "seed_means": {k: round(statistics.fmean(r[k] for r in rs) / statistics.fmean(r[k] for r in fcfs), 3)
                               for k in KEYS}}
        if "waiting_decode_share" in rs[0]:
            cell["waiting_decode_share"] = {"seed0": round(rs[0]["waiting_decode_share"], 3),
                                            "median": round(statistics.median(r["waiting_decode_share"] for r in rs), 3)}
        out[name] = cell
    return out


def gpu_ratios(d: dict[str, Any], trace: str) -> dict[str, Any]:
    runs = {r["policy"]: r for r in d["runs"] if r["trace"] == trace}
    f = runs["fcfs"]
    return {name: {k: round(runs[name][a][b] / f[a][b], 3) for k, (a, b) in KEYS.items()} for name in SETUPS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    d = json.loads(GPU.read_text(encoding="utf-8"))
    s = d["settings"]
    metrics: dict[str, Any] = {}
    for trace in s["traces"]:
        gpu = gpu_ratios(d, trace)
        gcap = d["calibration"][f"{trace}@{s['chunks'][0]}"]["capacity_req_s"]
        metrics[trace] = {"gpu": gpu, "gpu_capacity_req_s": round(gcap, 3)}
        for label, pool in (("model", None), ("model_kv_pool", s["pool_tokens"])):
            model = metrics[trace][label] = replay(trace, s, a.seeds, pool)
            print(f"{trace} @ {s['chunks'][0]}, {'no KV limit' if pool is None else f'KV pool {pool} tokens'}: "
                  f"capacity GPU {gcap:.2f} / model {model['capacity_req_s']:.2f} req/s; "
                  f"ratios to fcfs, GPU / model seed 0 / model {a.seeds}-seed means")
            for name in SETUPS:
                m = model[name]
                line = "  ".join(f"{k} {gpu[name][k]:.2f} / {m['seed0'][k]:.2f} / {m['seed_means'][k]:.2f}" for k in KEYS)
                share = m.get("waiting_decode_share")
                print(f"  {name:24s} {line}" + (f"  decode share while waiting (model) {share['seed0']:.3f} / "
                                                 f"{share['median']:.3f}" if share else ""))
    if a.record:
        out = record("fair_sched", OUT, f"python benchmarks/fair_sched/sim_h100_8l_check.py --seeds {a.seeds} --record",
                     metrics, shared=grid.SIM_SHARED, seeds=a.seeds, gpu_file=GPU.name,
                     kind="simulation (costs fitted to the 8-layer H100 run) beside that run")
        print(f"recorded {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
