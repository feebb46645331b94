"""Replay shared-prefix multi-turn traces against two real SGLang servers on CPU: L1 only vs stock
HiCache (L2 + SGLang's file L3) vs kv_tiers (L2 + checked file L3, fetch-or-recompute, selective
writes), the L3 folder shared by the two servers in both tiered setups.

Per setup the two servers start once and serve every trace in turn (L1 and L2 flushed between
traces; L3 keeps what it has, traces share no tokens). A request goes to a server picked by a
seeded coin (a load balancer that knows nothing of prefixes), so about half of the turns of a
conversation land on the other server: there only a shared L3 can serve its prefix. Traces:
synthetic (trace_gen, Mooncake format), ShareGPT-derived (sharegpt_trace, real multi-turn
conversations) and a no-reuse control. Per setup and trace: hit rate per tier (L1 = device radix
cache; L2 = host loads minus those that came from L3; L3 = tokens prefetched from storage), TTFT
mean/P50/P99 (streaming, first chunk), goodput at a TTFT SLO (requests within the SLO per second
of makespan). Prints ratios against L1 only, writes benchmarks/results/kv_tiers.json and appends
a row to benchmarks/RESULTS.md.

Stock HiCache needs kv_tiers' CPU compatibility hooks (unpinned host pool, torch direct copy) to
run on this platform at all, so its setup loads the plugin with the policies off
(adaptive_thresholds=false) and SGLang's own `file` backend.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kllm_plugins.models.tiny_llama import tiny_llama_path
from kllm_plugins.testing.kv_tiers import flush, kv_tiers_stats, l3_args
from kllm_plugins.testing.sglang_server import SGLangServer, start_all

sys.path.insert(0, str(Path(__file__).parent))
from trace_gen import generate, tokens_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def setup_args(name: str, store: str) -> tuple[list[str], list[str], dict[str, str]]:
    env = {"KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.kv_tiers.hookimpls"}
    if name == "l1_only":
        return [], [], {}
    if name == "hicache":
        env.update({"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": store, "KLLM_KV_TIERS_ADAPTIVE_THRESHOLDS": "false"})
        return l3_args("file"), ["kv_tiers"], env
    env.update({"KLLM_KV_TIERS_STORE_DIR": store})
    return l3_args("kllm_file"), ["kv_tiers"], env


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


def replay(servers: list[SGLangServer], trace: list[dict[str, Any]], concurrency: int,
           seed: int) -> list[dict[str, Any]]:
    """Closed loop, `concurrency` requests in flight per server; each request on a coin-picked server."""
    rng = random.Random(seed)
    queues: list[list[int]] = [[] for _ in servers]
    for i in range(len(trace)):
        queues[rng.randrange(len(servers))].append(i)
    results: list[dict[str, Any] | None] = [None] * len(trace)
    lock = threading.Lock()

    def worker(sidx: int) -> None:
        while True:
            with lock:
                if not queues[sidx]:
                    return
                i = queues[sidx].pop(0)
            r = trace[i]
            ttft, e2e, meta = stream_generate(servers[sidx].base_url, tokens_for(r["hash_ids"]),
                                              int(r["output_length"]))
            results[i] = {"ttft_s": ttft, "e2e_s": e2e, "input": int(r["input_length"]),
                          "cached": int(meta.get("cached_tokens", 0)), "server": sidx}
            print(f"\r  {sum(x is not None for x in results)}/{len(trace)}", end="", file=sys.stderr, flush=True)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(len(servers)) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(file=sys.stderr)
    return [x for x in results if x is not None]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _counters(servers: list[SGLangServer], plugins: list[str]) -> tuple[int, int]:
    """(tokens loaded from L2 by the kv_tiers hook, tokens prefetched from L3) over the servers so far."""
    l2 = sum(int(kv_tiers_stats(s).get("l2_loaded_tokens", 0)) for s in servers) if plugins else 0
    l3 = sum(int(m) for s in servers for line in s.grep_log(r"HiCache prefetch success")
             for m in re.findall(r"loaded=(\d+)", line))
    return l2, l3


def run_setup(name: str, traces: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    store = tempfile.mkdtemp(prefix=f"kvt-bench-{name}-")
    extra, plugins, env = setup_args(name, store)
    common = ["--page-size", "16", "--chunked-prefill-size", "512"]
    servers = [SGLangServer(tiny_llama_path(), plugins=plugins, extra_args=common + extra,
                            env={**env, "KLLM_KV_TIERS_INSTANCE_ID": f"{name}-{i}"},
                            max_total_tokens=args.l1_tokens, startup_timeout_s=400) for i in range(2)]
    runs = []
    try:
        start_all(servers)
        for s in servers:
            stream_generate(s.base_url, list(range(200, 232)), 2)  # warm-up
        for tname, trace in traces.items():
            if tname.endswith(" unique") and name not in args.unique_setups.split(","):
                continue
            for s in servers:
                flush(s.base_url)
            time.sleep(1.0)
            l2_0, l3_0 = _counters(servers, plugins)
            t0 = time.perf_counter()
            res = replay(servers, trace, args.concurrency, args.seed)
            makespan = time.perf_counter() - t0
            time.sleep(1.5)  # stats snapshots are written every 0.5 s
            l2_1, l3_1 = _counters(servers, plugins)
            stats = [kv_tiers_stats(s) for s in servers] if plugins else []
            runs.append(summarize(name, tname, res, makespan, l2_1 - l2_0, l3_1 - l3_0, stats, args))
            print(f"  {name} / {tname}: {makespan:.1f} s", file=sys.stderr)
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(store, ignore_errors=True)
    return runs


def summarize(name: str, tname: str, res: list[dict[str, Any]], makespan: float, l2_loaded: int, l3_loaded: int,
              stats: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    total_in = sum(r["input"] for r in res)
    cached = sum(r["cached"] for r in res)
    ttfts = [r["ttft_s"] for r in res]
    good = sum(1 for t in ttfts if t <= args.slo_s)
    keep = ("pages_admitted", "pages_skipped", "prefetch_admitted", "prefetch_refused", "l2_loaded_tokens")
    return {
        "setup": name,
        "trace": tname,
        "requests": len(res),
        "servers": 2,
        "hit_rate": {"l1": max(0, cached - l2_loaded) / total_in, "l2": max(0, l2_loaded - l3_loaded) / total_in,
                     "l3": l3_loaded / total_in, "total": cached / total_in},
        "ttft_s": {"mean": statistics.fmean(ttfts), "p50": pct(ttfts, 0.5), "p99": pct(ttfts, 0.99)},
        "throughput_req_s": len(res) / makespan,
        "throughput_at_slo_req_s": good / makespan,
        "slo_ttft_s": args.slo_s,
        "l1_tokens": args.l1_tokens,
        "l2_tokens": 2 * args.l1_tokens if name != "l1_only" else 0,
        "kv_tiers_stats": [{k: v for k, v in s.items() if k in keep} | {"store": s.get("store", {}).get("hits")}
                           for s in stats],
    }


def build_traces(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for t in args.traces.split(","):
        if t == "synthetic":
            out[f"synthetic sessions={args.sessions} turns={args.turns}"] = list(generate(args.sessions, args.turns))
        elif t == "sharegpt":
            from sharegpt_trace import build

            out[f"sharegpt conversations={args.conversations} turns<=3"] = build(args.conversations)
        elif t == "unique":
            out[f"synthetic sessions={args.sessions} turns={args.turns} unique"] = list(
                generate(args.sessions, args.turns, unique=True))
        else:
            raise SystemExit(f"unknown trace {t!r}")
    # each trace in its own block-id (token) space: the servers' L3 keeps earlier traces' pages
    for k, trace in enumerate(out.values()):
        for r in trace:
            r["hash_ids"] = [h + (k << 24) for h in r["hash_ids"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="kv_tiers: L1 only vs stock HiCache vs kv_tiers, two servers, replayed traces")
    ap.add_argument("--setups", default="l1_only,hicache,kv_tiers")
    ap.add_argument("--traces", default="synthetic,sharegpt,unique")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--unique-setups", default="l1_only,kv_tiers", help="setups that also run the no-reuse trace")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight per server")
    ap.add_argument("--l1-tokens", type=int, default=1024, help="--max-total-tokens (device KV) per server")
    ap.add_argument("--slo-s", type=float, default=2.0, help="TTFT SLO for goodput")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request-to-server coin")
    ap.add_argument("--no-record", action="store_true", help="do not write results files")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    traces = build_traces(args)
    command = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:])
    runs: list[dict[str, Any]] = []
    for name in args.setups.split(","):
        print(f"== {name}", file=sys.stderr)
        runs += run_setup(name, traces, args)
    print(f"two servers, concurrency {args.concurrency} per server, L1 {args.l1_tokens} tokens per server, "
          f"L2 2x L1, SLO TTFT {args.slo_s} s")
    for tname, trace in traces.items():
        rows = [r for r in runs if r["trace"] == tname]
        base = next((r for r in rows if r["setup"] == "l1_only"), rows[0])
        print(f"\ntrace: {tname}, {len(trace)} requests")
        print(f"{'setup':10} {'hit l1':>7} {'l2':>6} {'l3':>6} {'total':>6} {'ttft mean':>9} {'p50':>6} {'p99':>6} "
              f"{'req/s':>6} {'@slo':>6} {'mean/base':>9} {'@slo/base':>9}")
        for r in rows:
            h, t = r["hit_rate"], r["ttft_s"]
            ratio_mean = t["mean"] / base["ttft_s"]["mean"]
            ratio_slo = (r["throughput_at_slo_req_s"] / base["throughput_at_slo_req_s"]
                         if base["throughput_at_slo_req_s"] else float("nan"))
            print(f"{r['setup']:10} {h['l1']:7.3f} {h['l2']:6.3f} {h['l3']:6.3f} {h['total']:6.3f} {t['mean']:9.3f} "
                  f"{t['p50']:6.3f} {t['p99']:6.3f} {r['throughput_req_s']:6.3f} {r['throughput_at_slo_req_s']:6.3f} "
                  f"{ratio_mean:9.3f} {ratio_slo:9.3f}")
    if args.no_record:
        return
    out = ROOT / "benchmarks" / "results" / "kv_tiers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(out.read_text()) if out.exists() else {"command": command, "runs": []}
    doc["command"] = command
    doc["runs"] = [r for r in doc["runs"] if r.get("servers") == 2 and r["trace"] not in traces] + runs
    out.write_text(json.dumps(doc, indent=1) + "\n")
    cells = []
    for tname in traces:
        cells.append(f"[{tname}] " + "; ".join(
            f"{r['setup']}: hit {r['hit_rate']['total']:.3f} (l1 {r['hit_rate']['l1']:.3f}/l2 {r['hit_rate']['l2']:.3f}"
            f"/l3 {r['hit_rate']['l3']:.3f}), TTFT mean {r['ttft_s']['mean']:.3f} p50 {r['ttft_s']['p50']:.3f} "
            f"p99 {r['ttft_s']['p99']:.3f} s, {r['throughput_at_slo_req_s']:.3f} req/s at SLO"
            for r in runs if r["trace"] == tname))
    with (ROOT / "benchmarks" / "RESULTS.md").open("a") as f:
        f.write(f"\n## kv_tiers (issue 7), CPU (2 cores, shared), tiny Llama, two servers, {time.strftime('%Y-%m-%d')}\n"
                f"`{command}` — concurrency {args.concurrency} per server, L1 {args.l1_tokens} tokens per server, "
                f"L2 2x L1, shared L3 folder, SLO TTFT {args.slo_s} s: " + " ".join(cells) + "\n")


if __name__ == "__main__":
    main()
