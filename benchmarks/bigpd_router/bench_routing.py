"""Prefix-affinity routing against round-robin on a prefix-sharing workload (real SGLang on CPU).

Two real `sglang.launch_server` instances (tiny model, KV capped by --max-total-tokens) behind
kllm-router, once with --policy slo_affinity and once with --policy round_robin, on the same
seeded request sequence: F families of long shared prefixes, each request = a family prefix
plus a unique question. The families together do not fit in one instance's KV but half of them
do, so where requests land decides the prefix-cache hit rate and with it the TTFT. Caches are
flushed between the runs. Reported: cache hit rate (cached/prompt tokens, from SGLang's
meta_info), client TTFT median and P90, and wall time.

    python benchmarks/bigpd_router/bench_routing.py --families 10 --requests 80 --concurrency 4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from typing import Any

import aiohttp

sys.path.insert(0, os.path.dirname(__file__))
from loadgen import free_port, merge_results, py, spawn, stop, wait_http  # noqa: E402

from kllm_plugins.bench import stats  # noqa: E402
from kllm_plugins.bench.client import astream  # noqa: E402
from kllm_plugins.testing.sglang_server import SGLangServer, flush_cache  # noqa: E402

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river mountain forest ocean "
         "cloud stone metal glass paper engine signal vector matrix kernel cache router memory prefix").split()


def families(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"[system {k}] " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\n" for k in range(n)]


async def run_policy(rurl: str, reqs: list[tuple[int, str]], concurrency: int) -> dict[str, Any]:
    ttfts: list[float] = []
    cached = prompt = 0
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal cached, prompt
        while not queue.empty():
            _, text = queue.get_nowait()
            body = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            r = await astream(s, rurl + "/generate", body)
            assert r.ok and r.meta, f"{r.status} {r.error}"
            ttfts.append(0.0 if math.isnan(r.ttft_s) else r.ttft_s)
            cached += r.meta["cached_tokens"]
            prompt += r.meta["prompt_tokens"]

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"hit_rate": cached / prompt if prompt else 0.0, "ttft_p50_s": stats.quantile(ttfts, 0.5),
            "ttft_p90_s": stats.quantile(ttfts, 0.9), "wall_s": wall, "requests": len(reqs),
            "prompt_tokens": prompt, "cached_tokens": cached}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", type=int, default=10)
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-record", action="store_true", help="do not write the results file (smoke runs)")
    args = ap.parse_args()
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    model = tiny_llama_path()
    fams = families(args.families, args.prefix_words, args.seed)
    rng = random.Random(args.seed + 1)
    reqs = [(k, fams[k] + f"Question {i}: what about {rng.choice(WORDS)}?")
            for i, k in enumerate(rng.randrange(args.families) for _ in range(args.requests))]
    tmp = tempfile.mkdtemp(prefix="kllm-bench-")
    servers = [SGLangServer(model, max_total_tokens=args.max_total_tokens) for _ in range(2)]
    results: dict[str, Any] = {}
    try:
        for s in servers:
            s.start()
        for policy in ("round_robin", "slo_affinity"):
            for s in servers:
                flush_cache(s.base_url)
            port = free_port()
            cmd = [py(), "-m", "kllm_plugins.plugins.bigpd_router.service.cli", "--port", str(port),
                   "--policy", policy, "--log-level", "WARNING"]
            for s in servers:
                cmd += ["--worker", s.base_url]
            proc = spawn(cmd, f"{tmp}/router-{policy}.log")
            try:
                wait_http(f"http://127.0.0.1:{port}/health", 60)
                results[policy] = asyncio.run(run_policy(f"http://127.0.0.1:{port}", reqs, args.concurrency))
            finally:
                stop(proc)
            print(policy, json.dumps(results[policy]))
    finally:
        for s in servers:
            s.stop()
    rr, aff = results["round_robin"], results["slo_affinity"]
    print(f"\n{'':<14}{'round_robin':>14}{'slo_affinity':>14}{'ratio':>8}")
    for key in ("hit_rate", "ttft_p50_s", "ttft_p90_s", "wall_s"):
        ratio = aff[key] / rr[key] if rr[key] else float("nan")
        print(f"{key:<14}{rr[key]:>14.3f}{aff[key]:>14.3f}{ratio:>8.2f}")
    cmd = "python " + " ".join(sys.argv)
    if not args.no_record:
        merge_results("routing", [dict(policy=k, **v) for k, v in results.items()], cmd)
    print(f"| bigpd_router | prefix affinity vs round-robin, 2 real tiny-model SGLang servers (CPU), "
          f"{args.families} prefix families, {args.requests} req, conc {args.concurrency} | "
          f"hit rate {rr['hit_rate']:.2f} -> {aff['hit_rate']:.2f}; TTFT p50 {rr['ttft_p50_s']*1000:.0f} -> "
          f"{aff['ttft_p50_s']*1000:.0f} ms ({aff['ttft_p50_s']/rr['ttft_p50_s']:.2f}x), p90 "
          f"{rr['ttft_p90_s']*1000:.0f} -> {aff['ttft_p90_s']*1000:.0f} ms | `{cmd}` |")


if __name__ == "__main__":
    main()
