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
import os
import random
import sys
import tempfile
import time
import urllib.request
from typing import Any

import aiohttp

sys.path.insert(0, os.path.dirname(__file__))
from loadgen import free_port, merge_results, py, quantile, spawn, stop, wait_http  # noqa: E402

from kllm_plugins.testing.sglang_server import SGLangServer  # noqa: E402

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
            t0 = time.perf_counter()
            first = None
            last = b""
            async with s.post(rurl + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                async for chunk in r.content.iter_any():
                    if first is None:
                        first = time.perf_counter() - t0
                    last = (last + chunk)[-8192:]
            ttfts.append(first or 0.0)
            events = [ln for ln in last.split(b"\n") if ln.startswith(b"data:") and b"[DONE]" not in ln]
            meta = json.loads(events[-1][5:])["meta_info"]
            cached += meta["cached_tokens"]
            prompt += meta["prompt_tokens"]

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"hit_rate": cached / prompt if prompt else 0.0, "ttft_p50_s": quantile(ttfts, 0.5),
            "ttft_p90_s": quantile(ttfts, 0.9), "wall_s": wall, "requests": len(reqs),
            "prompt_tokens": prompt, "cached_tokens": cached}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", type=int, default=10)
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results-md", default="benchmarks/RESULTS.md")
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
                urllib.request.urlopen(urllib.request.Request(s.base_url + "/flush_cache", method="POST"), timeout=30)
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
    merge_results("routing", [dict(policy=k, **v) for k, v in results.items()], cmd)
    if args.results_md:
        new = not os.path.exists(args.results_md)
        with open(args.results_md, "a", encoding="utf-8") as fh:
            if new:
                fh.write("# Benchmark results\n\n")
            fh.write(f"| bigpd_router | prefix affinity vs round-robin, 2 real tiny-model SGLang servers (CPU), "
                     f"{args.families} prefix families, {args.requests} req, conc {args.concurrency} | "
                     f"hit rate {rr['hit_rate']:.2f} -> {aff['hit_rate']:.2f}; TTFT p50 {rr['ttft_p50_s']*1000:.0f} -> "
                     f"{aff['ttft_p50_s']*1000:.0f} ms ({aff['ttft_p50_s']/rr['ttft_p50_s']:.2f}x), p90 "
                     f"{rr['ttft_p90_s']*1000:.0f} -> {aff['ttft_p90_s']*1000:.0f} ms | `{cmd}` |\n")


if __name__ == "__main__":
    main()
