"""Replay a shared-prefix multi-turn trace against real SGLang servers on CPU: L1 only vs stock
HiCache (L2 + file L3) vs kv_tiers (L2 + checked file L3, fetch-or-recompute, selective writes).

One server at a time, same trace, same flags except the cache tiers. Per setup: hit rate per tier
(L1 = device radix cache; L2 = host loads minus those that came from L3; L3 = tokens prefetched
from storage), TTFT mean/P50/P99 (streaming, first chunk), goodput at a TTFT SLO (requests within
the SLO per second of makespan). Prints ratios against L1 only, writes
benchmarks/results/kv_tiers.json and appends a row to benchmarks/RESULTS.md.

Stock HiCache needs kv_tiers' CPU compatibility hooks (unpinned host pool, torch direct copy) to
run on this platform at all, so its setup loads the plugin with the policies off
(adaptive_thresholds=false) and SGLang's own `file` backend.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kllm_plugins.models.tiny_llama import tiny_llama_path
from kllm_plugins.testing.sglang_server import SGLangServer

sys.path.insert(0, str(Path(__file__).parent))
from trace_gen import generate, tokens_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = "kllm_plugins.plugins.kv_tiers.sglang_adapter"
HICACHE = ["--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
           "--hicache-write-policy", "write_through"]


def setup_args(name: str, store: str) -> tuple[list[str], list[str], dict[str, str]]:
    env = {"KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.kv_tiers.hookimpls"}
    if name == "l1_only":
        return [], [], {}
    if name == "hicache":
        env.update({"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": store, "KLLM_KV_TIERS_ADAPTIVE_THRESHOLDS": "false"})
        return HICACHE + ["--hicache-storage-backend", "file"], ["kv_tiers"], env
    extra = {"backend_name": "kllm_file", "module_path": ADAPTER, "class_name": "KllmFileStorage"}
    env.update({"KLLM_KV_TIERS_STORE_DIR": store})
    return HICACHE + ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                      json.dumps(extra)], ["kv_tiers"], env


def stream_generate(base_url: str, ids: list[int], max_new_tokens: int) -> tuple[float, float, dict[str, Any]]:
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    req = urllib.request.Request(f"{base_url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(line[5:])
    return ttft or float("nan"), time.perf_counter() - t0, last.get("meta_info", {})


def replay(server: SGLangServer, trace: list[dict[str, Any]], concurrency: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any] | None] = [None] * len(trace)
    cursor = [0]
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = cursor[0]
                cursor[0] += 1
            if i >= len(trace):
                return
            r = trace[i]
            ttft, e2e, meta = stream_generate(server.base_url, tokens_for(r["hash_ids"]), int(r["output_length"]))
            results[i] = {"ttft_s": ttft, "e2e_s": e2e, "input": int(r["input_length"]),
                          "cached": int(meta.get("cached_tokens", 0))}
            print(f"\r  {sum(x is not None for x in results)}/{len(trace)}", end="", file=sys.stderr, flush=True)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(file=sys.stderr)
    return [x for x in results if x is not None]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run_setup(name: str, trace: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    store = tempfile.mkdtemp(prefix=f"kvt-bench-{name}-")
    extra, plugins, env = setup_args(name, store)
    common = ["--page-size", "16", "--chunked-prefill-size", "512"]
    try:
        with SGLangServer(tiny_llama_path(), plugins=plugins, extra_args=common + extra, env=env,
                          max_total_tokens=args.l1_tokens, startup_timeout_s=400) as server:
            stream_generate(server.base_url, list(range(200, 232)), 2)  # warm-up
            t0 = time.perf_counter()
            res = replay(server, trace, args.concurrency)
            makespan = time.perf_counter() - t0
            time.sleep(1.0)
            stats: dict[str, Any] = {}
            if plugins:
                procs = server.get_json("/kllm/stats").get("kv_tiers", {}).get("processes", {})
                stats = next(iter(procs.values()), {})
            l3_loaded = sum(int(m) for line in server.grep_log(r"HiCache prefetch success")
                            for m in re.findall(r"loaded=(\d+)", line))
    finally:
        shutil.rmtree(store, ignore_errors=True)
    total_in = sum(r["input"] for r in res)
    cached = sum(r["cached"] for r in res)
    l2_loaded = int(stats.get("l2_loaded_tokens", 0))
    ttfts = [r["ttft_s"] for r in res]
    good = sum(1 for t in ttfts if t <= args.slo_s)
    return {
        "setup": name,
        "trace": args.trace_name,
        "requests": len(res),
        "hit_rate": {"l1": (cached - l2_loaded) / total_in, "l2": max(0, l2_loaded - l3_loaded) / total_in,
                     "l3": l3_loaded / total_in, "total": cached / total_in},
        "ttft_s": {"mean": statistics.fmean(ttfts), "p50": pct(ttfts, 0.5), "p99": pct(ttfts, 0.99)},
        "throughput_req_s": len(res) / makespan,
        "throughput_at_slo_req_s": good / makespan,
        "slo_ttft_s": args.slo_s,
        "kv_tiers_stats": {k: v for k, v in stats.items() if k in ("pages_admitted", "pages_skipped", "store",
                                                                   "prefetch_admitted", "prefetch_refused")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="kv_tiers: L1 only vs stock HiCache vs kv_tiers on a replayed trace")
    ap.add_argument("--setups", default="l1_only,hicache,kv_tiers")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--unique", action="store_true", help="no-reuse control trace")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--l1-tokens", type=int, default=1024, help="--max-total-tokens (device KV)")
    ap.add_argument("--slo-s", type=float, default=2.0, help="TTFT SLO for goodput")
    ap.add_argument("--no-record", action="store_true", help="do not write results files")
    args = ap.parse_args()
    args.trace_name = f"synthetic sessions={args.sessions} turns={args.turns}{' unique' if args.unique else ''}"
    trace = list(generate(args.sessions, args.turns, unique=args.unique))
    command = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:])
    runs = []
    for name in args.setups.split(","):
        print(f"== {name}", file=sys.stderr)
        runs.append(run_setup(name, trace, args))
    base = next((r for r in runs if r["setup"] == "l1_only"), runs[0])
    print(f"trace: {args.trace_name}, {len(trace)} requests, concurrency {args.concurrency}, L1 {args.l1_tokens} tokens")
    print(f"{'setup':10} {'hit l1':>7} {'l2':>6} {'l3':>6} {'total':>6} {'ttft mean':>9} {'p50':>6} {'p99':>6} "
          f"{'req/s':>6} {'@slo':>6} {'p50/base':>8} {'@slo/base':>9}")
    for r in runs:
        h, t = r["hit_rate"], r["ttft_s"]
        ratio_p50 = t["p50"] / base["ttft_s"]["p50"]
        ratio_slo = r["throughput_at_slo_req_s"] / base["throughput_at_slo_req_s"] if base["throughput_at_slo_req_s"] else float("nan")
        print(f"{r['setup']:10} {h['l1']:7.3f} {h['l2']:6.3f} {h['l3']:6.3f} {h['total']:6.3f} {t['mean']:9.3f} "
              f"{t['p50']:6.3f} {t['p99']:6.3f} {r['throughput_req_s']:6.3f} {r['throughput_at_slo_req_s']:6.3f} "
              f"{ratio_p50:8.3f} {ratio_slo:9.3f}")
    if args.no_record:
        return
    out = ROOT / "benchmarks" / "results" / "kv_tiers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(out.read_text()) if out.exists() else {"command": command, "runs": []}
    doc["command"] = command
    doc["runs"] = [r for r in doc["runs"] if r["trace"] != args.trace_name] + runs
    out.write_text(json.dumps(doc, indent=1) + "\n")
    results = ROOT / "benchmarks" / "RESULTS.md"
    if not results.exists():
        results.write_text("# Benchmark results\n")
    cells = "; ".join(f"{r['setup']}: hit {r['hit_rate']['total']:.3f} (l1 {r['hit_rate']['l1']:.3f}/l2 "
                      f"{r['hit_rate']['l2']:.3f}/l3 {r['hit_rate']['l3']:.3f}), TTFT p50 {r['ttft_s']['p50']:.3f} s "
                      f"p99 {r['ttft_s']['p99']:.3f} s, {r['throughput_at_slo_req_s']:.3f} req/s at SLO" for r in runs)
    with results.open("a") as f:
        f.write(f"\n## kv_tiers (issue 7), CPU (2 cores, shared), tiny Llama, {time.strftime('%Y-%m-%d')}\n"
                f"`{command}` — {args.trace_name}, concurrency {args.concurrency}, L1 {args.l1_tokens} tokens, "
                f"SLO TTFT {args.slo_s} s: {cells}\n")


if __name__ == "__main__":
    main()
