"""GPU row of bigpd_router: cache-affinity routing against round-robin on a multi-turn trace.

Two SGLang instances share the GPU (kllm_cuda, 8B-shaped random bf16 model, CUDA graphs on, a
memory fraction each, KV capped with --max-total-tokens) and publish their KV events over ZMQ
(`--kv-events-config`); kllm-router runs in front of them twice, with `--policy slo_affinity`
(routes a prefill to the instance whose KV events show its prefix) and `--policy round_robin`.

Trace: `--conversations` multi-turn conversations of `--turns` turns; turn k of a conversation
sends its whole history (a `--system-tokens` system prompt of its own, then every earlier user
turn and answer) plus a new `--user-tokens` turn, greedy `--output-tokens` answer. Conversations
are interleaved (round k of every conversation, in a seeded order, then round k+1), `--concurrency`
requests in flight. Half the conversations' histories fit in one instance's KV, so where a turn
lands decides its prefix hit. Caches are flushed before each run; the policies alternate per
repeat (ABBA). Reported per policy: hit rate (cached / prompt tokens, SGLang's meta_info), TTFT
mean / P50 / P90, wall time; ratios of affinity to round-robin with spread over repeats.

    python benchmarks/gpu/router_affinity_gpu.py --repeats 2 --out F.json [--cpu-dry-run]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fair_sched"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bigpd_router"))
from gpu_bench_common import Setup, header, log, spread, write  # noqa: E402
from loadgen import free_port, py, spawn, stop, wait_http  # noqa: E402
from serving import Job, run_jobs  # noqa: E402

from kllm_plugins.bench.stats import distribution, ratio_of_medians  # noqa: E402
from kllm_plugins.testing.sglang_server import PORT_PLACEHOLDER, flush_cache, start_all  # noqa: E402

POLICIES = ("slo_affinity", "round_robin")


def conversations(a: argparse.Namespace, vocab: int) -> list[list[tuple[list[int], list[int]]]]:
    """Per conversation, per turn: (new user tokens, the answer's stand-in tokens kept in the history)."""
    rng = random.Random(a.seed)
    tok = lambda n: [rng.randrange(10, vocab - 10) for _ in range(n)]  # noqa: E731
    return [[(tok(a.system_tokens + a.user_tokens if t == 0 else a.user_tokens), tok(a.output_tokens))
             for t in range(a.turns)] for _ in range(a.conversations)]


def run_policy(url: str, convs: list[list[tuple[list[int], list[int]]]], a: argparse.Namespace, tag: str) -> dict[str, Any]:
    rng = random.Random(a.seed + 1)
    outs = []
    t0 = time.perf_counter()
    for turn in range(a.turns):
        order = list(range(len(convs)))
        rng.shuffle(order)
        jobs = []
        for c in order:
            history = [x for u, ans in convs[c][:turn] for x in (*u, *ans)]
            jobs.append(Job(f"{tag}-c{c}-t{turn}", 0.0, history + convs[c][turn][0], a.output_tokens, f"turn{turn}"))
        for i in range(0, len(jobs), a.concurrency):
            outs += run_jobs(url, jobs[i:i + a.concurrency])
    wall = time.perf_counter() - t0
    later = [o for o in outs if o.kind != "turn0"]  # turns that have a history to hit
    d = distribution([o.ttft_s for o in later], (0.5, 0.9))
    return {"requests": len(outs), "wall_s": wall,
            # answers shorter than asked (greedy, no stop): an aborted or refused request
            "short_answers": sum(o.output_len < a.output_tokens for o in outs),
            "hit_rate": sum(o.cached_tokens for o in later) / max(1, sum(o.prompt_len for o in later)),
            "ttft_mean_s": d["mean"], "ttft_p50_s": d["p50"], "ttft_p90_s": d["p90"]}


def kv_pool(url: str) -> int:
    """The KV pool an instance got (tokens), from SGLang's /server_info."""
    import urllib.request

    with urllib.request.urlopen(url + "/server_info", timeout=10) as r:
        info = json.loads(r.read())
    return int(info["max_total_num_tokens"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=4096)
    ap.add_argument("--user-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-tokens", type=int, default=0, help="KV per instance (0: half the trace's histories)")
    ap.add_argument("--mem-fraction", type=float, default=0.4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0,
                    help="hidden layers of the 8B-width model (0: 32); fewer leave each instance its KV on an 80 GB card")
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    setup = Setup(a.cpu_dry_run, **({"num_hidden_layers": a.layers} if a.layers else {}))
    if setup.cpu:  # the tiny model's 8K context and this CPU
        a.system_tokens, a.user_tokens, a.output_tokens = min(a.system_tokens, 512), min(a.user_tokens, 64), min(a.output_tokens, 8)
        a.conversations, a.turns, a.concurrency = min(a.conversations, 8), min(a.turns, 3), min(a.concurrency, 4)
    history = a.system_tokens + a.turns * (a.user_tokens + a.output_tokens)
    kv = a.kv_tokens or max(4 * history, a.conversations * history // 2)
    res = header("benchmarks/gpu/router_affinity_gpu.py", "python " + " ".join(sys.argv), setup,
                 {k: v for k, v in vars(a).items() if k not in ("out", "cpu_dry_run")} | {"kv_tokens_per_instance": kv})
    events = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{PORT_PLACEHOLDER}", "topic": ""})
    servers = [setup.server([], ["--chunked-prefill-size", "8192", "--kv-events-config", events], {}, kv, a.mem_fraction,
                            graphs=True, strict=False, name=f"affinity-{i}") for i in range(2)]
    convs = conversations(a, setup.vocab)
    tmp = tempfile.mkdtemp(prefix="kllm-affinity-gpu-")
    routers: dict[str, tuple[Any, str]] = {}
    rows: list[dict[str, Any]] = []
    try:
        start_all(servers)
        res["kv_pool_tokens"] = [kv_pool(s.base_url) for s in servers]
        write(a.out, res)
        if min(res["kv_pool_tokens"]) < kv:  # the memory fraction left less KV than the trace is sized for
            raise SystemExit(f"router_affinity_gpu: KV pools {res['kv_pool_tokens']} < {kv} tokens asked; "
                             "raise --mem-fraction or lower --layers")
        for pol in POLICIES:
            port = free_port()
            proc = spawn([py(), "-m", "kllm_plugins.plugins.bigpd_router.service.cli", "--port", str(port), "--policy", pol,
                          "--log-level", "WARNING", *[x for s in servers for x in ("--worker", s.base_url)]],
                         f"{tmp}/router-{pol}.log")
            routers[pol] = (proc, f"http://127.0.0.1:{port}")
            wait_http(routers[pol][1] + "/health", 90)
        time.sleep(2.0)  # the routers' first health pass and KV-event subscriptions
        warm = conversations(argparse.Namespace(**{**vars(a), "seed": a.seed + 99, "conversations": 2}), setup.vocab)
        for pol in POLICIES:  # warm-up: Triton kernels, graphs, connections
            run_policy(routers[pol][1], warm, a, f"warm-{pol}")
        for rep in range(a.repeats):
            for pol in (POLICIES if rep % 2 == 0 else POLICIES[::-1]):
                for s in servers:
                    flush_cache(s.base_url)
                time.sleep(1.0)  # the flush's KV events reach the router
                row = {"repeat": rep, "policy": pol, **run_policy(routers[pol][1], convs, a, f"r{rep}-{pol}")}
                rows.append(row)
                log("affinity", str(row))
                res["rows"] = rows
                write(a.out, res)
    finally:
        for proc, _ in routers.values():
            stop(proc)
        for s in servers:
            s.stop()
    metrics: dict[str, Any] = {}
    for pol in POLICIES:
        rs = [r for r in rows if r["policy"] == pol]
        if rs:
            metrics[pol] = {k: spread([r[k] for r in rs]) for k in ("hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "wall_s")}
            metrics[pol]["short_answers"] = sum(r["short_answers"] for r in rs)
    pairs = [({r["policy"]: r for r in rows if r["repeat"] == k}) for k in range(a.repeats)]
    pairs = [p for p in pairs if len(p) == 2]
    if pairs:  # repeats interleave the policies: paired ratios
        metrics["affinity_over_round_robin"] = {
            k: ratio_of_medians([p["slo_affinity"][k] for p in pairs], [p["round_robin"][k] for p in pairs], paired=True)
            for k in ("ttft_mean_s", "ttft_p90_s", "wall_s")}
        metrics["hit_points_gained"] = spread([100 * (p["slo_affinity"]["hit_rate"] - p["round_robin"]["hit_rate"]) for p in pairs])
    res["metrics"] = metrics
    write(a.out, res)
    log("affinity", json.dumps(metrics.get("affinity_over_round_robin", {})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
