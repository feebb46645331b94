"""What-if check (a model, not a measurement): the GPU rows of fair_sched asked of the simulated
clock. For every H200 cell of the 8B shape recorded by `benchmarks/gpu/fair_sched_gpu.py` (`gpu_*.json`: trace, chunk,
requests, load), `sim_engine.py` with its H200-fitted costs replays the same requests (the GPU
harness's trace scale, lengths in chunks of 2048 cut at 40,960), at the same fraction of the fcfs
capacity measured the same way (a burst of the calibration requests), then the same cell on
`--seeds` seeds. Per cell and target: the ratio the GPU measured, the ratio the model gives for the
same seed, the model's ratio of seed means and the share of single seeds on which the target
misses. Then TPOT and P99 against fcfs of the stock orders and of fair_sched with more or fewer
decode steps: its `decode_share` (at most one decode step per prefill pass) and its
`decode_time_share` (several in a row where that share of the time takes them). The model has no
KV limit (no chunk guard) save in the two `KV pool` columns (the cell's pool, `sim_engine.Engine.pool`,
ratios to fcfs on that pool), and no prefix cache (lpm equals fcfs).

    python benchmarks/fair_sched/sim_gpu_replay.py --seeds 20      # run, record, print
    python benchmarks/fair_sched/sim_gpu_replay.py --write-doc      # table in docs/fair_sched_studies.md
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
import targets  # noqa: E402
import sim_engine as se  # noqa: E402
import traces as tr  # noqa: E402

from kllm_plugins.bench.record import build_summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "fair_sched"
OUT = RESULTS / "sim_gpu_replay.json"
DOC = ROOT / "docs" / "fair_sched_studies.md"
POLICIES = ("fcfs", "shortest-prefill-first", "hrrn", "fair_sched")
TARGETS = tuple(t[0] for t in targets.TARGETS)
DECODE_SHARES = (0.0, 0.04, 0.1, 0.3)
TIME_SHARES = (0.05, 0.1, 0.2, 0.35)
SHORT = {"mean <= best stock": "mean", "short p90 <= best stock": "short P90", "p99 <= fcfs": "P99",
         "long mean <= 1.25x fcfs": "long mean", "tpot <= 1.3x fcfs": "TPOT", "throughput >= 0.98x fcfs": "throughput"}


def gpu_cells(folder: Path = RESULTS) -> list[dict[str, Any]]:
    """The recorded GPU cells: trace, chunk, requests, load, calibration size and fair_sched's measured ratios."""
    out = []
    for path in sorted(folder.glob("gpu_*.json")):
        d = json.loads(path.read_text(encoding="utf-8"))
        s = d["settings"]
        if s.get("layers", 32) != 32 or "H200" not in d["machine"].get("gpu", ""):
            continue  # the model's costs are fitted to the 8B shape (32 layers) on the H200
        cal = int(s.get("cal_requests") or _flag(d["command"], "--cal-requests", "24"))  # 24: the harness's default
        for key, cell in d["metrics"].items():
            if "targets" in cell:
                trace, chunk, *at = key.split("@")  # `trace@chunk@load` where a file ran several loads
                out.append({"trace": trace, "chunk": int(chunk), "requests": int(s["requests"]),
                            "load": float(at[0] if at else s["load"]),
                            "trace_chunk": int(s["trace_chunk"]), "max_prompt": int(s["max_prompt"]),
                            "out_tokens": list(s["output_tokens"]), "cal_requests": cal, "file": path.name,
                            "pool_tokens": int(s.get("pool_tokens", 57344)),
                            "gpu": {k: v["value"] for k, v in cell["targets"].items()}})
    return sorted(out, key=lambda c: (c["trace"], c["chunk"]))


def _flag(command: str, flag: str, default: str) -> str:
    words = command.split()
    return words[words.index(flag) + 1] if flag in words else default


def seed_runs(jobs: list[list[Any]], rate: float, chunk: int, cm: Any, long_tokens: int, policy: str,
              env: list[str], overlap: bool = False, lag: int = 0, pool: int | None = None) -> list[dict[str, float]]:
    """`policy` (with fair_sched's options `env`) on each seed's requests: `sim_engine.summary` per
    seed, with fair_sched's decode share of the time while prompts waited (its own account).
    `overlap` / `lag`: the clock as SGLang's overlap scheduler gives it and fair_sched's timing lag;
    `pool`: a KV pool of that many tokens."""
    cfg = grid.config_from(env)
    out = []
    for seed, j in enumerate(jobs):
        pol = se.make_policy(policy, chunk, cfg)
        if not isinstance(pol, str):
            pol.pol.timing_lag = lag
        row = se.summary(se.simulate(j, rate, pol, chunk, cm, seed, overlap=overlap, pool_tokens=pool), long_tokens)
        if not isinstance(pol, str):
            w = pol.pol.waiting_s
            row["waiting_decode_share"] = w["decode"] / max(w["decode"] + w["prefill"], 1e-12)
        out.append(row)
    return out


def simulate_cell(c: dict[str, Any], seeds: int) -> dict[str, Any]:
    scale = tr.gpu_scale(c["trace_chunk"], c["max_prompt"], *c["out_tokens"])
    cm, chunk = se.COSTS["h200"], c["chunk"]
    cal = tr.make(c["trace"], scale, c["cal_requests"], 99)
    cap = se.capacity(cal, chunk, cm)
    long_tokens = 8 * c["trace_chunk"] - 1  # the GPU harness: long = at least 8 trace chunks
    jobs = [tr.make(c["trace"], scale, c["requests"], seed) for seed in range(seeds)]
    runs = functools.partial(seed_runs, jobs, c["load"] * cap, chunk, cm, long_tokens)

    at = {p: runs(p, []) for p in POLICIES}
    per_seed = [grid.checks({p: [at[p][i]] for p in POLICIES}, "fair_sched") for i in range(seeds)]
    out: dict[str, Any] = {"capacity_req_s": round(cap, 4), "same_seed": {k: v["value"] for k, v in per_seed[0].items()}}
    out["seed_ratio_median"] = {k: round(statistics.median(x[k]["value"] for x in per_seed), 3) for k in TARGETS}
    out["miss_share"] = {k: round(sum(not x[k]["met"] for x in per_seed) / len(per_seed), 3) for k in TARGETS}
    # TPOT and P99 against fcfs (ratios of seed means): the stock orders that beat fcfs on the mean,
    # and fair_sched with more or fewer decode steps: its decode_share (at most one per prefill pass)
    # and its decode_time_share (several in a row where that share of the time takes them).
    fcfs = {k: statistics.fmean(r[k] for r in at["fcfs"]) for k in ("tpot", "p99", "mean")}
    trade = {p: at[p] for p in ("shortest-prefill-first", "hrrn")}
    trade.update({f"decode_share {d}": runs("fair_sched", [f"decode_share={d}"]) for d in DECODE_SHARES})
    trade.update({f"decode_time_share {x}": runs("fair_sched", ["decode_share=0", f"decode_time_share={x}"])
                  for x in TIME_SHARES})
    # SGLang's mixed chunk (fair_sched's mixed_decode): every prefill pass also decodes the running requests.
    trade["mixed_decode"] = runs("fair_sched", ["mixed_decode=1"])
    # The clock as SGLang's overlap scheduler on a GPU gives it (a pass timed when the next one
    # starts): read without the one-pass lag (fair_sched before b5a7031, every GPU row so far)
    # and with it.
    for lag in (0, 1):
        trade[f"decode_time_share 0.2, overlap timing, lag {lag}"] = runs(
            "fair_sched", ["decode_share=0", "decode_time_share=0.2"], overlap=True, lag=lag)
    trade["defaults, overlap timing, lag 1"] = runs("fair_sched", [], overlap=True, lag=1)
    # with the cell's KV pool (the model has no limit otherwise; sim_engine.Engine.pool): ratios to
    # fcfs on the same pool and arrivals
    fcfs_pool = {k: statistics.fmean(r[k] for r in runs("fcfs", [], pool=c["pool_tokens"])) for k in fcfs}
    base = {}
    for name, env in (("defaults", []), ("decode_time_share 0.2", ["decode_share=0", "decode_time_share=0.2"])):
        key = f"{name}, overlap timing, lag 1, KV pool"
        trade[key] = runs("fair_sched", env, overlap=True, lag=1, pool=c["pool_tokens"])
        base[key] = fcfs_pool
    out["tpot_p99_vs_fcfs"] = {name: {k: round(statistics.fmean(r[k] for r in rs) / base.get(name, fcfs)[k], 3)
                                      for k in fcfs}
                               for name, rs in trade.items()}
    # how much of the time decode held while prompts waited (median over seeds): where a
    # decode_time_share below it seldom binds
    out["waiting_decode_share"] = {name: round(statistics.median(r["waiting_decode_share"] for r in rs), 3)
                                   for name, rs in trade.items() if "waiting_decode_share" in rs[0]}
    return out


def run(seeds: int) -> dict[str, Any]:
    cells = []
    for c in gpu_cells():
        c["sim"] = simulate_cell(c, seeds)
        cells.append(c)
    return build_summary(f"python benchmarks/fair_sched/sim_gpu_replay.py --seeds {seeds}",
                         {f"{c['trace']}@{c['chunk']}": {"gpu": c["gpu"], **c["sim"]} for c in cells},
                         shared=grid.SIM_SHARED, seeds=seeds, kind="simulation (H200-fitted costs) of the recorded GPU cells")


def table(summary: dict[str, Any]) -> str:
    head = ["| trace @ chunk | " + " | ".join(SHORT[k] for k in TARGETS) + " |", "|" + "---|" * (len(TARGETS) + 1)]
    body = []
    for key, m in summary["metrics"].items():
        cells = []
        for k in TARGETS:
            g, s, med, miss = m["gpu"][k], m["same_seed"][k], m["seed_ratio_median"][k], m["miss_share"][k]
            # no long prompt on the GPU: no ratio (NaN, None once recorded)
            cells.append("-" if g is None or g != g else f"{g:.2f} / {s:.2f} / {med:.2f} ({miss:.0%})")
        body.append(f"| {key.replace('@', ' @ ')} | " + " | ".join(cells) + " |")
    return "\n".join(head + body) + "\n"


def trade_table(summary: dict[str, Any]) -> str:
    """TPOT and P99 / fcfs (ratios of seed means) of the stock orders and of fair_sched's decode-step settings."""
    first = next(iter(summary["metrics"].values()))["tpot_p99_vs_fcfs"]
    names = list(first)
    head = ["| trace @ chunk | " + " | ".join(n.replace("shortest-prefill-first", "SPF") for n in names) + " |",
            "|" + "---|" * (len(names) + 1)]
    body = [f"| {key.replace('@', ' @ ')} | " + " | ".join(
        f"{m['tpot_p99_vs_fcfs'][n]['tpot']:.2f} / {m['tpot_p99_vs_fcfs'][n]['p99']:.2f}" for n in names) + " |"
        for key, m in summary["metrics"].items()]
    return "\n".join(head + body) + "\n"


def render(text: str, summary: dict[str, Any]) -> str:
    from kllm_plugins.plugin_docs import replace_generated

    cmd = "python benchmarks/fair_sched/sim_gpu_replay.py --write-doc"
    text = replace_generated(text, "sim-gpu-replay", table(summary), cmd, "docs/fair_sched_studies.md")
    return replace_generated(text, "sim-gpu-trade", trade_table(summary), cmd, "docs/fair_sched_studies.md")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--write-doc", action="store_true", help="only rewrite the table from the recorded summary")
    a = ap.parse_args()
    return grid.record_or_write_doc(a.write_doc, OUT, DOC, lambda: run(a.seeds), lambda s: table(s) + "\n" + trade_table(s), render)

if __name__ == "__main__":
    sys.exit(main())
