"""Benchmark: stock SGLang policies (fcfs, lpm, shortest-prefill-first) vs fair_sched on one trace,
on real CPU SGLang servers with the tiny model. Not collected by pytest.

Workload (issue 4): chunk 128; 95% one-chunk prompts (32-128 tokens) and 5% long (2.5K-5K);
outputs 16-32 tokens (ignore_eos); Poisson arrivals at `--load` of capacity. Capacity is
calibrated in the first server (solo TTFT of a short and a long prompt), and every policy then
replays the same trace. Prints per-policy TTFT (overall, short, long), TPOT and throughput, and
each policy's ratio to fcfs; appends a row to benchmarks/RESULTS.md and writes
benchmarks/results/fair_sched.json.

    python benchmarks/fair_sched/bench_fair_sched.py --requests 80 --load 0.6 --seeds 1
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving import Job, Outcome, run_jobs, sglang_server  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
POLICIES = ("fcfs", "lpm", "shortest-prefill-first", "fair_sched")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def make_trace(n: int, rate: float, seed: int, long_frac: float, long_range: tuple[int, int]) -> list[Job]:
    rng = random.Random(seed)
    n_long = max(1, round(n * long_frac))
    long_idx = set(rng.sample(range(n), n_long))
    t = 0.0
    jobs = []
    for i in range(n):
        t += rng.expovariate(rate)
        is_long = i in long_idx
        plen = rng.randint(*long_range) if is_long else rng.randint(32, 128)
        ids = [rng.randrange(5, 4090) for _ in range(plen)]
        jobs.append(Job(f"s{seed}-r{i}", t, ids, rng.randint(16, 32), "long" if is_long else "short"))
    return jobs


def during_long(outs: list[Outcome]) -> list[float]:
    """TTFT of the short requests that arrived while a long request was waiting for its first token."""
    windows = [(o.arrival_s, o.arrival_s + o.ttft_s) for o in outs if o.kind == "long"]
    return [o.ttft_s for o in outs if o.kind == "short" and any(a <= o.arrival_s <= b for a, b in windows)]


def summarize(outs: list[Outcome], wall_s: float) -> dict[str, Any]:
    ttft = [o.ttft_s for o in outs]
    hit = during_long(outs)
    short = [o.ttft_s for o in outs if o.kind == "short"]
    long_ = [o.ttft_s for o in outs if o.kind == "long"]
    tpot = [o.tpot_s for o in outs if o.output_len > 1]
    return {
        "ttft_s": {"mean": statistics.fmean(ttft), "p50": pct(ttft, 0.5), "p90": pct(ttft, 0.9),
                   "p95": pct(ttft, 0.95), "p99": pct(ttft, 0.99)},
        "ttft_short_s": {"mean": statistics.fmean(short), "p50": pct(short, 0.5), "p90": pct(short, 0.9),
                         "p99": pct(short, 0.99)},
        "ttft_long_s": {"mean": statistics.fmean(long_), "max": max(long_)},
        "ttft_short_during_long_s": {"n": len(hit), "mean": statistics.fmean(hit) if hit else float("nan")},
        "tpot_s": {"mean": statistics.fmean(tpot), "p50": pct(tpot, 0.5)},
        "throughput_req_s": len(outs) / wall_s,
        "wall_s": wall_s,
    }


def calibrate(url: str, seed: int, long_range: tuple[int, int]) -> dict[str, float]:
    rng = random.Random(1000 + seed)
    mean_long = sum(long_range) // 2
    shorts = [Job(f"cal-s{i}", 0.0, [rng.randrange(5, 4090) for _ in range(80)], 24, "short") for i in range(3)]
    long_job = Job("cal-l", 0.0, [rng.randrange(5, 4090) for _ in range(mean_long)], 24, "long")
    # Warm up first: the first requests after start-up pay one-off costs (several seconds here).
    run_jobs(url, [Job(f"warm{i}", 0.0, [rng.randrange(5, 4090) for _ in range(n)], 8, "short")
                   for i, n in enumerate((80, 300, 80))])
    t_short = statistics.median(run_jobs(url, [j])[0].ttft_s for j in shorts)
    out = run_jobs(url, [long_job])[0]
    return {"short_ttft_s": t_short, "long_ttft_s": out.ttft_s, "long_tokens": float(mean_long)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--load", type=float, nargs="+", default=[0.6])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--long-min", type=int, default=2500)
    ap.add_argument("--long-max", type=int, default=5000)
    ap.add_argument("--long-frac", type=float, default=0.05)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--capacity-factor", type=float, default=0.75)
    ap.add_argument("--rate", type=float, default=0.0, help="fixed capacity in req/s (skips calibration)")
    ap.add_argument("--fair-env", nargs="*", default=[], help="KLLM_FAIR_SCHED_*=value for the fair_sched server")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "fair_sched.json"))
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--reanalyze", default="", help="recompute the table from a (partial) JSON of this script")
    ap.add_argument("--plot", default=os.path.join(ROOT, "benchmarks", "results", "fair_sched_ttft.png"))
    args = ap.parse_args()
    if args.reanalyze:
        reanalyze(args)
        return

    from kllm_plugins.models.tiny_llama import tiny_llama_path

    model = str(tiny_llama_path())
    long_range = (args.long_min, args.long_max)
    command = "python " + " ".join(sys.argv)
    runs: list[dict[str, Any]] = []
    calib: dict[str, float] | None = None
    fair_stats: dict[str, Any] = {}
    traces: dict[tuple[float, int], list[Job]] = {}
    # Seed r runs every policy in one server each; odd seeds reverse the order (ABBA), so slow
    # drift of a shared machine's load does not favour the policies that happen to run first.
    for seed in range(args.seeds):
        order = list(args.policies) if seed % 2 == 0 else list(reversed(args.policies))
        for policy in order:
            calib, stats_now = run_policy(policy, seed, args, model, long_range, calib, traces, runs, command)
            if stats_now:
                fair_stats = stats_now
    report(runs, args, command, calib or {}, fair_stats)
    if args.plot:
        plot(runs, args.plot)


def reanalyze(args: Any) -> None:
    """Rebuild per-request outcomes from a JSON (arrivals come from the seeded trace) and report."""
    with open(args.reanalyze, encoding="utf-8") as fh:
        data = json.load(fh)
    runs = data["runs"]
    long_range = (args.long_min, args.long_max)
    for r in runs:
        jobs = make_trace(args.requests, r["rate_req_s"], r["seed"], args.long_frac, long_range)
        outs = [Outcome(j.rid, kind, plen, j.arrival_s, ttft, ttft, 2, [], None)
                for j, (kind, plen, ttft, _tpot) in zip(jobs, r["requests"])]
        hit = during_long(outs)
        r["ttft_short_during_long_s"] = {"n": len(hit), "mean": statistics.fmean(hit) if hit else float("nan")}
    args.load = sorted({r["load"] for r in runs})
    args.seeds = len({r["seed"] for r in runs})
    report(runs, args, data["command"], data.get("calibration", {}), data.get("fair_sched_counters", {}))
    if args.plot:
        plot(runs, args.plot)


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """TTFT distributions (CDF) per policy: all, short and long requests, every load and seed pooled."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, kind in zip(axes, ("all", "short", "long")):
        for policy in POLICIES:
            xs = sorted(t for r in runs if r["policy"] == policy for k, _, t, _ in r["requests"] if kind in ("all", k))
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=policy)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_title(f"TTFT CDF: {kind} requests")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", flush=True)


def run_policy(policy: str, seed: int, args: Any, model: str, long_range: tuple[int, int],
               calib: dict[str, float] | None, traces: dict[tuple[float, int], list[Job]],
               runs: list[dict[str, Any]], command: str) -> tuple[dict[str, float], dict[str, Any]]:
    plugins = ["fair_sched"] if policy == "fair_sched" else []
    sched = "fcfs" if policy == "fair_sched" else policy
    env = dict(kv.split("=", 1) for kv in args.fair_env) if policy == "fair_sched" else {}
    extra = ["--chunked-prefill-size", str(args.chunk), "--schedule-policy", sched]
    fair_stats: dict[str, Any] = {}
    t0 = time.time()
    with sglang_server(model, plugins=plugins, extra_args=extra, max_total_tokens=32768, env=env) as srv:
        print(f"[{policy}] server up in {time.time() - t0:.0f}s", flush=True)
        if calib is None and args.rate:
            calib = {"capacity_req_s": args.rate, "long_ttft_s": float("nan"), "long_tokens": 1.0}
        if calib is None:
            calib = calibrate(srv.base_url, 0, long_range)
            # Capacity from solo prefill times; 0.75 is the decode share the baseline
            # implies (2.3 req/s at 0.6 of capacity with 0.05 s shorts and ~3 s longs).
            service = (1 - args.long_frac) * calib["short_ttft_s"] + args.long_frac * calib["long_ttft_s"]
            calib["capacity_req_s"] = args.capacity_factor / service
            print(f"calibration: {calib}", flush=True)
        else:
            run_jobs(srv.base_url, [Job(f"warm{i}-{policy}-{seed}", 0.0, list(range(5 + i, 300 + i)), 8, "short")
                                    for i in range(3)])
        for load in args.load:
            rate = load * calib["capacity_req_s"]
            jobs = traces.setdefault((load, seed), make_trace(args.requests, rate, seed, args.long_frac, long_range))
            start = time.perf_counter()
            outs = run_jobs(srv.base_url, jobs)
            wall = time.perf_counter() - start
            row = {"load": load, "seed": seed, "policy": policy, "rate_req_s": rate, **summarize(outs, wall)}
            row["long_slowdown_max"] = max(
                o.ttft_s / (calib["long_ttft_s"] * o.prompt_len / calib["long_tokens"]) for o in outs if o.kind == "long"
            )
            row["output_ids"] = {o.rid: o.output_ids for o in outs}
            row["requests"] = [[o.kind, o.prompt_len, round(o.ttft_s, 4), round(o.tpot_s, 4)] for o in outs]
            runs.append(row)
            if not args.no_record:  # keep partial results if the run is cut short
                os.makedirs(os.path.dirname(args.out), exist_ok=True)
                with open(args.out + ".partial", "w", encoding="utf-8") as fh:
                    json.dump({"command": command, "calibration": calib, "runs": runs}, fh)
            print(f"[{policy}] load={load} seed={seed} rate={rate:.3f}/s wall={wall:.0f}s "
                  f"ttft mean={row['ttft_s']['mean']:.2f} p50={row['ttft_s']['p50']:.2f} "
                  f"p90={row['ttft_s']['p90']:.2f} p99={row['ttft_s']['p99']:.2f} "
                  f"short p90={row['ttft_short_s']['p90']:.2f} long mean={row['ttft_long_s']['mean']:.2f} "
                  f"tpot={row['tpot_s']['mean'] * 1000:.0f}ms thr={row['throughput_req_s']:.3f}", flush=True)
        if policy == "fair_sched":
            fair_stats = srv.get_json("/kllm/stats").get("fair_sched", {}).get("total", {})
            print(f"[fair_sched] counters: {fair_stats}", flush=True)
    return calib, fair_stats


def _median(rows: list[dict[str, Any]], path: tuple[str, ...]) -> float:
    vals = []
    for r in rows:
        v: Any = r
        for p in path:
            v = v[p]
        vals.append(float(v))
    return statistics.median(vals)


METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("TTFT mean", ("ttft_s", "mean")), ("TTFT p50", ("ttft_s", "p50")), ("TTFT p90", ("ttft_s", "p90")),
    ("TTFT p95", ("ttft_s", "p95")), ("TTFT p99", ("ttft_s", "p99")), ("short TTFT p90", ("ttft_short_s", "p90")),
    ("long TTFT mean", ("ttft_long_s", "mean")), ("short-in-long mean", ("ttft_short_during_long_s", "mean")), ("TPOT mean", ("tpot_s", "mean")),
    ("throughput req/s", ("throughput_req_s",)),
)


def report(runs: list[dict[str, Any]], args: Any, command: str, calib: dict[str, float], fair_stats: dict[str, Any]) -> None:
    lines = []
    for load in args.load:
        at = [r for r in runs if r["load"] == load]
        policies = [p for p in POLICIES if any(r["policy"] == p for r in at)]
        lines.append(f"load {load} (median over {args.seeds} seed(s); ratio to fcfs in brackets)")
        lines.append(f"{'metric':18s}" + "".join(f"{p:>28s}" for p in policies))
        for name, path in METRICS:
            base = _median([r for r in at if r["policy"] == "fcfs"], path) if any(r["policy"] == "fcfs" for r in at) else None
            cells = []
            for p in policies:
                v = _median([r for r in at if r["policy"] == p], path)
                cells.append(f"{v:10.3f} [{v / base:5.2f}x]" if base else f"{v:10.3f}")
            lines.append(f"{name:18s}" + "".join(f"{c:>28s}" for c in cells))
    same = []
    for r in runs:
        base = next((b for b in runs if b["policy"] == "fcfs" and b["load"] == r["load"] and b["seed"] == r["seed"]), None)
        if base is not None and r["policy"] != "fcfs":
            same.append(f"{r['policy']}@{r['load']}/s{r['seed']}: {'identical' if r['output_ids'] == base['output_ids'] else 'DIFFERENT'}")
    if same:
        lines.append("outputs vs fcfs: " + ", ".join(same))
    lines.append(f"capacity {calib.get('capacity_req_s', float('nan')):.3f} req/s (calibrated: {calib})")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.no_record:
        return
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"command": command, "calibration": calib, "fair_sched_counters": fair_stats, "runs": runs}, fh, indent=1)
    results_md = os.path.join(ROOT, "benchmarks", "RESULTS.md")
    if not os.path.exists(results_md):
        with open(results_md, "w", encoding="utf-8") as fh:
            fh.write("# Benchmark results\n")
    with open(results_md, "a", encoding="utf-8") as fh:
        fh.write(f"\n## fair_sched ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n`{command}`\n\n```\n{text}\n```\n")


if __name__ == "__main__":
    main()
