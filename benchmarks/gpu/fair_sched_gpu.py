"""GPU row of fair_sched: SGLang's stock policies (fcfs, lpm, shortest-prefill-first, hrrn) vs
fair_sched on the fair-scheduling trace family (benchmarks/fair_sched/traces.py), on SGLang
(kllm_cuda, 8B-shaped random bf16 model, CUDA graphs on) at chunk sizes 2048 and 8192.

The trace's lengths are drawn in chunks of 2048 tokens (`--trace bursty`: issue 27's losing trace,
90% of 0.25-2 chunks, 10% of 12-24 chunks, on/off arrivals), cut at `--max-prompt` (the random
model's KV pool on a GPU shared by five servers), and the same requests are replayed at both chunk
sizes. Per chunk size: one server per policy, all up at once; capacity measured on fcfs (a burst
of the trace's requests at once), the load a fraction of it; each seed runs the policies in order,
the next seed in reverse (ABBA); the prefix cache is flushed before every run. Streaming client:
benchmarks/fair_sched/serving.py; summaries: benchmarks/fair_sched/workload.py.

    python benchmarks/gpu/fair_sched_gpu.py --chunks 2048 8192 --requests 40 --out F.json [--cpu-dry-run]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fair_sched"))
from gpu_bench_common import Setup, header, log, write  # noqa: E402
from serving import Job, run_jobs  # noqa: E402
from traces import Scale, make, prompt_ids  # noqa: E402
from workload import summarize  # noqa: E402

POLICIES = ("fcfs", "lpm", "shortest-prefill-first", "hrrn", "fair_sched")
COUNTERS = ("yields_to_short", "yields_to_decode", "limited_passes", "long_started", "long_finished", "long_chunks",
            "chunks_cut_for_kv", "chunks_parked_for_kv")
KEYS = ("ttft_s", "ttft_short_s", "ttft_long_s")


def jobs_of(reqs: list[Any], rate: float, salt: str, trace_chunk: int, tag: str) -> list[Job]:
    return [Job(f"{tag}-{i}", r.arrival_s / rate if rate > 0 else 0.0, prompt_ids(r, salt=salt), r.output_len,
                "long" if r.input_len >= 8 * trace_chunk else "short") for i, r in enumerate(reqs)]


def flush(srv: Any) -> None:
    from kllm_plugins.testing.sglang_server import flush_cache

    flush_cache(srv.base_url)


def fair_counters(srv: Any) -> dict[str, float]:
    try:
        total = srv.get_json("/kllm/stats").get("fair_sched", {}).get("total", {})
    except Exception:  # noqa: BLE001 - informative only
        return {}
    return {k: float(total.get(k, 0)) for k in COUNTERS}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--trace", default="bursty")
    ap.add_argument("--trace-chunk", type=int, default=2048, help="the trace's lengths are in chunks of this size")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--cal-requests", type=int, default=24)
    ap.add_argument("--max-prompt", type=int, default=40960)
    ap.add_argument("--pool-tokens", type=int, default=57344)
    ap.add_argument("--out-tokens", type=int, nargs=2, default=[32, 128])
    ap.add_argument("--mem-fraction", type=float, default=0.9)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    setup = Setup(a.cpu_dry_run, max_positions=max(8192, a.max_prompt + 1024))
    scale = Scale(f"gpu{a.trace_chunk}", a.trace_chunk, a.max_prompt, a.out_tokens[0], a.out_tokens[1], 1 / 4, 14.0)
    res = header("benchmarks/gpu/fair_sched_gpu.py", "python " + " ".join(sys.argv), setup,
                 {"trace": a.trace, "trace_chunk": a.trace_chunk, "max_prompt": a.max_prompt, "requests": a.requests,
                  "load": a.load, "seeds": a.seeds, "chunks": a.chunks, "policies": a.policies,
                  "pool_tokens": a.pool_tokens, "output_tokens": a.out_tokens,
                  "long": f">= 8 x {a.trace_chunk} prompt tokens"})
    res["runs"], res["calibration"] = [], {}
    from kllm_plugins.testing.sglang_server import start_all

    t_start = time.perf_counter()
    for chunk in a.chunks:
        servers: dict[str, Any] = {}
        for p in a.policies:
            extra = ["--chunked-prefill-size", str(chunk), "--schedule-policy", "fcfs" if p == "fair_sched" else p]
            if setup.cpu:
                extra += ["--context-length", str(a.max_prompt + 1024)]
            env = {"KLLM_FAIR_SCHED_PUBLISH_INTERVAL_S": "0.1"} if p == "fair_sched" else {}
            if setup.cpu:
                env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
            servers[p] = setup.server(["fair_sched"] if p == "fair_sched" else [], extra, env, a.pool_tokens,
                                      a.mem_fraction, graphs=True, name=f"{p}-{chunk}")
        try:
            t0 = time.perf_counter()
            start_all(list(servers.values()))
            log("fair", f"chunk {chunk}: {len(servers)} servers up in {time.perf_counter() - t0:.0f} s")
            warm = make(a.trace, scale, 6, 97)
            with ThreadPoolExecutor(len(servers)) as pool:  # warm-up at once: Triton kernels, graphs
                list(pool.map(lambda kv: run_jobs(kv[1].base_url, jobs_of(warm, 0.0, "warm", a.trace_chunk, "warm")),
                              servers.items()))
            base = servers.get("fcfs") or next(iter(servers.values()))
            cal_reqs = make(a.trace, scale, a.cal_requests, 99)
            flush(base)
            t0 = time.perf_counter()
            run_jobs(base.base_url, jobs_of(cal_reqs, 0.0, "cal", a.trace_chunk, "cal"))
            capacity = a.cal_requests / (time.perf_counter() - t0)
            lo, hi = 12 * a.trace_chunk, min(24 * a.trace_chunk, a.max_prompt)
            solo = {}
            for n in (lo, hi):
                flush(base)
                solo[n] = run_jobs(base.base_url, [Job(f"solo-{n}", 0.0, [11 + (i * 7) % 3000 for i in range(n)], 4,
                                                       "long")])[0].ttft_s
            slope = (solo[hi] - solo[lo]) / (hi - lo) if hi > lo else 0.0
            solo_fn = lambda n: max(solo[lo] + slope * (n - lo), 1e-3)  # noqa: E731
            res["calibration"][str(chunk)] = {"capacity_req_s": capacity, "solo_long_ttft_s": {str(k): v for k, v in solo.items()}}
            log("fair", f"chunk {chunk}: capacity {capacity:.2f} req/s, solo long TTFT {solo}")
            rate = a.load * capacity
            for seed in range(a.seeds):
                reqs = make(a.trace, scale, a.requests, seed)
                order = list(a.policies) if seed % 2 == 0 else list(a.policies)[::-1]
                for p in order:
                    srv = servers[p]
                    flush(srv)
                    before = fair_counters(srv) if p == "fair_sched" else {}
                    t0 = time.perf_counter()
                    try:
                        outs = run_jobs(srv.base_url, jobs_of(reqs, rate, f"s{seed}", a.trace_chunk, f"{p}-{seed}"))
                    except Exception as exc:  # noqa: BLE001 - recorded with the server's state; the others go on
                        alive = (srv.proc is not None and srv.proc.poll() is None
                                 and not srv.grep_log(r"Scheduler hit an exception|SIGQUIT received"))
                        res.setdefault("errors", []).append({"chunk": chunk, "policy": p, "seed": seed, "error": repr(exc)[:500],
                                                             "server_alive": alive, "log_tail": srv.log_tail(40)[-4000:]})
                        write(a.out, res)
                        log("fair", f"chunk {chunk} {p} s{seed}: FAILED {exc!r} (server alive: {alive})")
                        continue
                    wall = time.perf_counter() - t0
                    row = {"chunk": chunk, "policy": p, "seed": seed, "rate_req_s": rate, "requests": len(outs),
                           **summarize(outs, wall, solo_fn)}
                    if before:
                        after = fair_counters(srv)
                        row["fair_sched_counters"] = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
                    res["runs"].append(row)
                    write(a.out, res)
                    log("fair", f"[{time.perf_counter() - t_start:.0f}s] chunk {chunk} {p} s{seed}: ttft mean "
                        f"{row['ttft_s']['mean']:.2f} p90 {row['ttft_s']['p90']:.2f} p99 {row['ttft_s']['p99']:.2f}; short p90 "
                        f"{row['ttft_short_s'].get('p90', float('nan')):.2f}; long mean "
                        f"{row['ttft_long_s'].get('mean', float('nan')):.2f}; tpot {1e3 * row['tpot_s']['mean']:.1f} ms; "
                        f"thr {row['throughput_req_s']:.2f} req/s {row.get('fair_sched_counters', '')}")
        finally:
            for srv in servers.values():
                srv.stop()
    res["metrics"] = metrics(res["runs"], a.chunks, a.policies)
    write(a.out, res)
    return 0


def metrics(runs: list[dict[str, Any]], chunks: list[int], policies: list[str]) -> dict[str, Any]:
    """Per chunk and policy: the medians over seeds of each figure (min/max beside), and each
    figure's ratio to fcfs (policy / fcfs; below 1 is better for TTFT and TPOT)."""
    import statistics

    out: dict[str, Any] = {}
    for chunk in chunks:
        cell: dict[str, Any] = {}
        for p in policies:
            rs = [r for r in runs if r["chunk"] == chunk and r["policy"] == p]
            if not rs:
                continue
            fig: dict[str, Any] = {}
            for key in KEYS:
                for q in ("mean", "p50", "p90", "p99"):
                    vals = [r[key][q] for r in rs if q in r[key]]
                    if vals:
                        fig[f"{key}_{q}"] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
            for key, sub in (("tpot_s", "mean"), ("long_ttft_over_solo", "max")):
                vals = [r[key][sub] for r in rs]
                fig[f"{key}_{sub}"] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
            vals = [r["throughput_req_s"] for r in rs]
            fig["throughput_req_s"] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
            cell[p] = fig
        if "fcfs" in cell:
            for p, fig in cell.items():
                if p != "fcfs":
                    fig["vs_fcfs"] = {k: fig[k]["median"] / cell["fcfs"][k]["median"] for k in fig
                                      if k in cell["fcfs"] and cell["fcfs"][k]["median"] > 0}
        out[str(chunk)] = cell
    return out


if __name__ == "__main__":
    sys.exit(main())
